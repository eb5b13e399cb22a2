//! offload-pack's checks: exact round trips (every bf16 pattern, every
//! code; random tensors), typed errors on corrupted blobs and files, the
//! packed container and its loader, the ratios on weights that look
//! trained, and the planted bugs that turn those checks red.

use std::path::Path;

use offload_core::model::DType;
use offload_pack::container::{
    MANIFEST_KEY, PackedCheckpoint, TensorIn, default_output, encode_in_memory, pack_checkpoint,
    write_model,
};
use offload_pack::format::{
    self, Code, DecodeError, EncodeConfig, EncodeError, MAX_LO, Packed, TILE_ELEMS, encode_bf16,
    encode_bf16_as,
};
use offload_pack::synth::{FluxShape, Law, pack_synthetic, tensor_bytes};
use offload_pack::{PackError, check_ratio};
use proptest::prelude::*;

fn bytes_of(bits: &[u16]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_le_bytes()).collect()
}

fn cfg1() -> EncodeConfig {
    EncodeConfig {
        threads: 1,
        ..EncodeConfig::default()
    }
}

/// Encodes `data` with `code`, checks the encoder's own round trip passed,
/// then decodes it again whole and tile by tile and compares.
fn round_trip(data: &[u8], code: Code, threads: usize) {
    let cfg = EncodeConfig {
        threads,
        ..EncodeConfig::default()
    };
    let enc = encode_bf16_as(data, code, &cfg).expect("round trip checked by the encoder");
    assert_eq!(enc.stats.code, code);
    assert_eq!(enc.blob.len() as u64, enc.stats.packed_bytes);
    assert_eq!(enc.blob.len() % format::ALIGN, 0);
    let p = Packed::parse(&enc.blob).expect("a fresh blob parses");
    assert_eq!(p.decode().expect("decodes"), data, "{code:?}");
    if let Code::Window3 { .. } = code {
        let mut out = vec![0u8; data.len()];
        for t in 0..p.n_tiles() {
            let r = p.tile_output(t);
            p.decode_tile(t, &mut out[r]).expect("tile decodes");
        }
        assert_eq!(out, data, "tile by tile, {code:?}");
    }
}

mod round_trips {
    use super::*;

    /// Every one of the 65,536 bf16 patterns (±0, subnormals, ±∞, every
    /// NaN) in every code: raw and the window at each of its 250 starts,
    /// in a scrambled order so that each tile mixes hits and escapes.
    #[test]
    fn every_bf16_pattern_in_every_code() {
        let bits: Vec<u16> = (0..=u16::MAX as u32)
            .map(|i| (i.wrapping_mul(40_503) & 0xffff) as u16)
            .collect();
        let mut seen = bits.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 65_536, "a permutation of every pattern");
        let data = bytes_of(&bits);
        round_trip(&data, Code::Raw, 1);
        for lo in 0..=MAX_LO {
            round_trip(&data, Code::Window3 { lo }, 2);
        }
        // And the encoder's own choice.
        let enc = encode_bf16(&data, &cfg1()).expect("encodes");
        assert_eq!(Packed::parse(&enc.blob).unwrap().decode().unwrap(), data);
    }

    /// Lengths at and around tile boundaries, 0 and 1 included, in both
    /// codes, one and several threads.
    #[test]
    fn tile_boundary_lengths() {
        for n in [
            0usize,
            1,
            2,
            31,
            32,
            33,
            4095,
            4096,
            4097,
            8191,
            8192,
            8193,
            3 * 4096 + 5,
        ] {
            let bits: Vec<u16> = (0..n)
                .map(|i| 0x3c00u16.wrapping_add((i * 7919) as u16))
                .collect();
            let data = bytes_of(&bits);
            for code in [
                Code::Raw,
                Code::Window3 { lo: 118 },
                Code::Window3 { lo: 0 },
            ] {
                round_trip(&data, code, 1);
                round_trip(&data, code, 3);
            }
        }
    }

    fn trained_like() -> impl Strategy<Value = u16> {
        // Mostly exponents near 120 (a weight's), some anything.
        prop_oneof![
            4 => (any::<bool>(), 112u16..128, 0u16..128).prop_map(|(s, e, m)| (u16::from(s) << 15) | (e << 7) | m),
            1 => any::<u16>(),
        ]
    }

    fn lengths() -> impl Strategy<Value = usize> {
        prop_oneof![
            Just(0usize),
            Just(1),
            Just(TILE_ELEMS - 1),
            Just(TILE_ELEMS),
            Just(TILE_ELEMS + 1),
            Just(2 * TILE_ELEMS),
            0usize..3 * TILE_ELEMS + 100,
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Random tensors of random lengths, in a random window, the
        /// encoder's choice and raw.
        #[test]
        fn random_tensors(
            bits in lengths().prop_flat_map(|n| proptest::collection::vec(trained_like(), n)),
            lo in 0u8..=MAX_LO,
            threads in 1usize..4,
        ) {
            let data = bytes_of(&bits);
            round_trip(&data, Code::Window3 { lo }, threads);
            round_trip(&data, Code::Raw, threads);
            let enc = encode_bf16(&data, &EncodeConfig { threads, ..EncodeConfig::default() }).unwrap();
            prop_assert_eq!(Packed::parse(&enc.blob).unwrap().decode().unwrap(), data);
        }
    }

    #[test]
    fn the_best_window_covers_the_most() {
        let mut hist = [0u64; 256];
        for (e, c) in [
            (10, 5u64),
            (100, 50),
            (101, 60),
            (102, 70),
            (106, 80),
            (107, 1),
            (108, 90),
        ] {
            hist[e] = c;
        }
        // 102..=108 holds 70 + 80 + 1 + 90 = 241; 100..=106 holds 260.
        assert_eq!(format::best_window(&hist), (100, 5 + 1 + 90));
        let mut hist = [0u64; 256];
        hist[255] = 9;
        hist[0] = 1;
        assert_eq!(format::best_window(&hist), (MAX_LO, 1));
    }

    #[test]
    fn small_and_incompressible_tensors_stay_raw() {
        let cfg = cfg1();
        // A norm of 128 weights: under one tile.
        let norm = bytes_of(&vec![0x3f80u16; 128]);
        assert_eq!(encode_bf16(&norm, &cfg).unwrap().stats.code, Code::Raw);
        // Uniformly random bit patterns: the window does not pay.
        let noise: Vec<u16> = (0..20_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 16) as u16)
            .collect();
        assert_eq!(
            encode_bf16(&bytes_of(&noise), &cfg).unwrap().stats.code,
            Code::Raw
        );
        // A weight-like tensor: coded.
        let w: Vec<u16> = (0..20_000u32)
            .map(|i| 0x3c00 | (i % 0x3ff) as u16)
            .collect();
        assert!(matches!(
            encode_bf16(&bytes_of(&w), &cfg).unwrap().stats.code,
            Code::Window3 { .. }
        ));
    }

    #[test]
    fn encoder_inputs_are_checked() {
        let cfg = cfg1();
        assert_eq!(
            encode_bf16(&[1, 2, 3], &cfg).unwrap_err(),
            EncodeError::OddLength { bytes: 3 }
        );
        assert_eq!(
            encode_bf16_as(&[0; 8], Code::Window3 { lo: 250 }, &cfg).unwrap_err(),
            EncodeError::WindowOutOfRange { lo: 250 }
        );
    }
}

mod corruption {
    use super::*;

    fn sample() -> Vec<u8> {
        let bits: Vec<u16> = (0..2 * TILE_ELEMS as u32 + 77)
            .map(|i| {
                if i % 23 == 0 {
                    0x0001
                } else {
                    0x3c00 | (i % 0x7ff) as u16
                }
            })
            .collect();
        let enc = encode_bf16_as(&bytes_of(&bits), Code::Window3 { lo: 118 }, &cfg1()).unwrap();
        assert!(enc.stats.escapes > 0);
        enc.blob
    }

    fn set_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn set_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Result<Vec<u8>, DecodeError> {
        Packed::parse(b)?.decode()
    }

    /// One row per kind of damage: the blob, and the error expected.
    #[test]
    fn damaged_blobs_give_typed_errors() {
        let good = sample();
        let idx = u64::from_le_bytes(good[40..48].try_into().unwrap()) as usize;
        let tiles = 3usize;
        let total_esc = u32::from_le_bytes(
            good[idx + 4 * tiles..idx + 4 * tiles + 4]
                .try_into()
                .unwrap(),
        );
        type Damage = Box<dyn Fn(&mut Vec<u8>)>;
        type Expect = fn(&DecodeError) -> bool;
        let rows: Vec<(&str, Damage, Expect)> = vec![
            ("empty", Box::new(|b| b.clear()), |e| {
                matches!(e, DecodeError::Truncated { what: "header", .. })
            }),
            ("header cut", Box::new(|b| b.truncate(40)), |e| {
                matches!(e, DecodeError::Truncated { .. })
            }),
            ("sections cut", Box::new(|b| b.truncate(200)), |e| {
                matches!(e, DecodeError::Truncated { .. })
            }),
            (
                "escapes cut",
                Box::new(|b| {
                    let n = b.len() - 64;
                    b.truncate(n)
                }),
                |e| {
                    matches!(
                        e,
                        DecodeError::Truncated {
                            what: "escapes",
                            ..
                        }
                    )
                },
            ),
            ("magic", Box::new(|b| b[0] = b'X'), |e| {
                matches!(e, DecodeError::BadMagic { .. })
            }),
            ("version", Box::new(|b| b[4] = 9), |e| {
                matches!(e, DecodeError::BadVersion { found: 9 })
            }),
            ("code id", Box::new(|b| b[6] = 7), |e| {
                matches!(e, DecodeError::BadCode { found: 7 })
            }),
            ("window start", Box::new(|b| b[7] = 250), |e| {
                matches!(
                    e,
                    DecodeError::BadHeader {
                        field: "window start",
                        ..
                    }
                )
            }),
            (
                "odd decoded bytes",
                Box::new(|b| {
                    let n = u64::from_le_bytes(b[8..16].try_into().unwrap());
                    set_u64(b, 8, n + 1)
                }),
                |e| matches!(e, DecodeError::BadHeader { .. }),
            ),
            (
                "huge decoded bytes",
                Box::new(|b| set_u64(b, 8, u64::MAX - 1)),
                |e| matches!(e, DecodeError::BadHeader { .. }),
            ),
            ("tile size", Box::new(|b| set_u32(b, 16, 1024)), |e| {
                matches!(
                    e,
                    DecodeError::BadHeader {
                        field: "tile weights",
                        ..
                    }
                )
            }),
            ("tile count", Box::new(|b| set_u32(b, 20, 2)), |e| {
                matches!(e, DecodeError::BadHeader { field: "tiles", .. })
            }),
            ("bit-plane offset", Box::new(|b| set_u64(b, 32, 64)), |e| {
                matches!(
                    e,
                    DecodeError::BadHeader {
                        field: "bit-plane offset",
                        ..
                    }
                )
            }),
            (
                "escapes offset",
                Box::new(|b| set_u64(b, 48, u64::MAX)),
                |e| matches!(e, DecodeError::BadHeader { .. }),
            ),
            ("blob length", Box::new(|b| set_u64(b, 56, 1 << 40)), |e| {
                matches!(
                    e,
                    DecodeError::BadHeader {
                        field: "blob length",
                        ..
                    }
                )
            }),
            ("index[0]", Box::new(move |b| set_u32(b, idx, 1)), |e| {
                matches!(e, DecodeError::BadHeader { .. })
            }),
            (
                "index past the escapes",
                Box::new(move |b| set_u32(b, idx + 4, total_esc + 5)),
                |e| matches!(e, DecodeError::BadEscapeIndex { tile: 0, .. }),
            ),
            (
                "index off by one",
                Box::new(move |b| {
                    let v = u32::from_le_bytes(b[idx + 4..idx + 8].try_into().unwrap());
                    set_u32(b, idx + 4, v - 1)
                }),
                |e| matches!(e, DecodeError::BadEscapeIndex { .. }),
            ),
            (
                "total escapes",
                Box::new(move |b| set_u32(b, idx + 4 * tiles, u32::MAX)),
                |e| matches!(e, DecodeError::BadHeader { .. }),
            ),
            (
                "a code turned escape",
                Box::new(|b| {
                    b[64 + 3 * 4096] = 0;
                    b[64 + 3 * 4096 + 512] = 0;
                    b[64 + 3 * 4096 + 1024] = 0
                }),
                |e| matches!(e, DecodeError::BadEscapeIndex { tile: 0, .. }),
            ),
        ];
        for (what, damage, expect) in rows {
            let mut b = good.clone();
            damage(&mut b);
            match decode(&b) {
                Err(e) => assert!(expect(&e), "{what}: got {e:?}"),
                Ok(_) => panic!("{what}: decoded"),
            }
        }
        // Tile 1's entries moved past the escapes, its count kept: only the
        // bound on `index[tile + 1]` stops tile 1 (decoded alone, as a GPU
        // block does) reading past the blob.
        let mut b = good.clone();
        let get = |b: &[u8], k: usize| {
            u32::from_le_bytes(b[idx + 4 * k..idx + 4 * k + 4].try_into().unwrap())
        };
        let count = get(&b, 2) - get(&b, 1);
        set_u32(&mut b, idx + 4, total_esc + 100_000);
        set_u32(&mut b, idx + 8, total_esc + 100_000 + count);
        let p = Packed::parse(&b).unwrap();
        assert!(matches!(
            p.decode_tile(1, &mut [0; 8192]),
            Err(DecodeError::BadEscapeIndex { tile: 1, .. })
        ));
        assert_eq!(
            p.escape_index_disorder(),
            Some(2),
            "the loader's check sees it too"
        );
        // Raw blobs too.
        let mut raw = format::encode_raw(&[1, 2, 3]).blob;
        raw[24] = 0;
        assert!(matches!(
            decode(&raw),
            Err(DecodeError::BadHeader {
                field: "data offset",
                ..
            })
        ));
        let p = Packed::parse(&good).unwrap();
        assert!(matches!(
            p.decode_tile(3, &mut [0; 8192]),
            Err(DecodeError::TileOutOfRange {
                tile: 3,
                n_tiles: 3
            })
        ));
        assert!(matches!(
            p.decode_tile(0, &mut [0; 10]),
            Err(DecodeError::OutputSize { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any damage (bytes overwritten, the blob cut anywhere) decodes or
        /// errs, never panics, and what decodes has the header's length.
        #[test]
        fn random_damage_never_panics(
            edits in proptest::collection::vec((0usize..40_000, any::<u8>()), 1..6),
            cut in proptest::option::of(0usize..40_000),
        ) {
            let mut b = sample();
            for (at, v) in edits {
                let n = b.len();
                b[at % n] = v;
            }
            if let Some(c) = cut {
                let n = b.len();
                b.truncate(c % (n + 1));
            }
            if let Ok(p) = Packed::parse(&b)
                && let Ok(out) = p.decode()
            {
                prop_assert_eq!(out.len() as u64, p.header().decoded_bytes);
            }
        }

        /// Damage in the header only, the part that says where everything is.
        #[test]
        fn random_header_damage_never_panics(edits in proptest::collection::vec((0usize..64, any::<u8>()), 1..4)) {
            let mut b = sample();
            for (at, v) in edits {
                b[at] = v;
            }
            let _ = decode(&b);
        }
    }
}

mod container {
    use super::*;

    /// A checkpoint with a coded bf16 weight, a raw bf16 norm and an f32
    /// tensor, as the safetensors writer lays it out.
    fn write_checkpoint(dir: &Path) -> Vec<(String, DType, Vec<u64>, Vec<u8>)> {
        let shape = FluxShape::small();
        let all = shape.tensors();
        let pick = [
            "transformer_blocks.0.attn.to_q.weight",
            "transformer_blocks.0.attn.to_q.bias",
            "transformer_blocks.0.attn.norm_q.weight",
            "proj_out.weight",
        ];
        let mut tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)> = all
            .iter()
            .enumerate()
            .filter(|(_, (n, _))| pick.contains(&n.as_str()))
            .map(|(i, (n, s))| {
                (
                    n.clone(),
                    DType::Bf16,
                    s.clone(),
                    tensor_bytes(Law::Normal, 7, i, n, s, &all, 2),
                )
            })
            .collect();
        tensors.push((
            "scale".into(),
            DType::F32,
            vec![3],
            [1.0f32, 2.0, 3.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ));
        offload_safetensors::write_file(&dir.join("diffusion_pytorch_model.safetensors"), &tensors)
            .unwrap();
        tensors
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("offload-pack-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn pack_open_decode_and_windows() {
        let dir = tmp("pack");
        let tensors = write_checkpoint(&dir);
        let out = default_output(&dir);
        assert_eq!(out, dir.join("diffusion_pytorch_model.opack"));
        let report = pack_checkpoint(&dir, &out, &cfg1()).unwrap();
        assert_eq!(report.tensors.len(), tensors.len());
        let codes: Vec<_> = report
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.stats.code))
            .collect();
        assert!(
            codes
                .iter()
                .any(|(n, c)| *n == "transformer_blocks.0.attn.to_q.weight"
                    && matches!(c, Code::Window3 { .. }))
        );
        assert!(codes.iter().any(|(n, c)| *n == "scale" && *c == Code::Raw));
        assert!(
            codes
                .iter()
                .any(|(n, c)| n.ends_with("norm_q.weight") && *c == Code::Raw)
        );
        // The plain checkpoint beside it still opens as it did.
        let plain = offload_safetensors::Checkpoint::open(&dir).unwrap();
        assert_eq!(plain.tensors().len(), tensors.len());

        let packed = PackedCheckpoint::open(&out).unwrap();
        assert_eq!(packed.decoded_bytes(), report.decoded_bytes);
        let mut names = Vec::new();
        for (name, _, shape, bytes) in &tensors {
            assert_eq!(&packed.decode(name, 2).unwrap(), bytes, "{name}");
            assert_eq!(&packed.tensors()[name].manifest.shape, shape);
            let w = packed.window(name).unwrap();
            assert_eq!(w.offset % 64, 0);
            assert_eq!(w.len % 64, 0);
            assert_eq!(w.page_offset, w.offset % 4096);
            assert!(w.pages.start <= w.offset && w.offset + w.len <= w.pages.end);
            let region = packed.region(&w).unwrap();
            assert_eq!(region.bytes(), packed.blob(name).unwrap());
            assert!(region.read_only());
            assert_eq!(
                region.enclosing().unwrap().len() as u64,
                packed.file_bytes()
            );
            names.push(name.as_str());
        }
        // The data starts on a page: the first blob's window.
        let first = names
            .iter()
            .map(|n| packed.window(n).unwrap().offset)
            .min()
            .unwrap();
        assert_eq!(first % 4096, 0);
        // Every tensor back to back: one window for all.
        let all = packed.span(&names).unwrap();
        assert_eq!(all.len, packed.packed_bytes());
        // The file is a safetensors container any reader opens.
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), tensors.len());
        assert!(matches!(
            packed.blob("nope"),
            Err(PackError::UnknownTensor { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_files_give_typed_errors() {
        let dir = tmp("bad");
        write_checkpoint(&dir);
        let out = dir.join("m.opack");
        pack_checkpoint(&dir, &out, &cfg1()).unwrap();
        let good = std::fs::read(&out).unwrap();
        let check = |name: &str, bytes: &[u8], expect: fn(&PackError) -> bool| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            match PackedCheckpoint::open(&p) {
                Err(e) => assert!(expect(&e), "{name}: {e}"),
                Ok(_) => panic!("{name}: opened"),
            }
        };
        // A plain safetensors file is not a packed one.
        let plain = std::fs::read(dir.join("diffusion_pytorch_model.safetensors")).unwrap();
        check(
            "plain",
            &plain,
            |e| matches!(e, PackError::Container { reason, .. } if reason.contains(MANIFEST_KEY)),
        );
        check("empty", &[], |e| matches!(e, PackError::Container { .. }));
        check("cut", &good[..good.len() - 64], |e| {
            matches!(e, PackError::Container { .. })
        });
        // A blob's header damaged: the first blob starts on the data page.
        let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize + 8;
        let mut bad = good.clone();
        bad[n] = b'X';
        check("blob magic", &bad, |e| {
            matches!(
                e,
                PackError::Blob {
                    source: DecodeError::BadMagic { .. },
                    ..
                }
            )
        });
        // The manifest disagreeing with a blob (its escapes).
        let text = String::from_utf8(good[8..n].to_vec()).unwrap();
        let at = text.find("\\\"escapes\\\":").unwrap() + 12;
        let mut t2 = text.clone().into_bytes();
        t2[at] = if t2[at] == b'9' { b'8' } else { b'9' };
        let mut bad = good.clone();
        bad[8..n].copy_from_slice(&t2);
        check("manifest escapes", &bad, |e| {
            matches!(e, PackError::Mismatch { .. } | PackError::Container { .. })
        });
        assert!(matches!(
            PackedCheckpoint::open(dir.join("absent")),
            Err(PackError::Io { .. })
        ));
        assert!(matches!(
            pack_checkpoint(&dir.join("absent"), &out, &cfg1()),
            Err(PackError::Checkpoint(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The command packs beside the checkpoint and prints every tensor's
    /// code and ratio and the totals; a bad file is one line of error and
    /// exit status 1.
    #[test]
    fn the_command_packs_and_reports() {
        let dir = tmp("cli");
        let tensors = write_checkpoint(&dir);
        let exe = env!("CARGO_BIN_EXE_offload-pack");
        let out = std::process::Command::new(exe)
            .arg(&dir)
            .args(["--threads", "2"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for (name, ..) in &tensors {
            assert!(text.contains(name.as_str()), "{name} missing from {text}");
        }
        assert!(text.contains("w3@") && text.contains("raw"), "{text}");
        assert!(
            text.contains("every round trip checked") && text.contains(" s on 2 threads"),
            "{text}"
        );
        let packed = PackedCheckpoint::open(dir.join("diffusion_pytorch_model.opack")).unwrap();
        assert_eq!(packed.tensors().len(), tensors.len());
        std::fs::write(dir.join("bad.bin"), b"not a checkpoint at all").unwrap();
        let bad = std::process::Command::new(exe)
            .arg(dir.join("bad.bin"))
            .output()
            .unwrap();
        assert_eq!(bad.status.code(), Some(1));
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(
            err.starts_with("offload-pack: error: packing") && err.lines().count() == 1,
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The fallback encodes in memory, logs that it did, and its file
    /// loads as one written by the command.
    #[test]
    fn encode_in_memory_logs_and_round_trips() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .finish();
        let bits: Vec<u16> = (0..3 * TILE_ELEMS as u32)
            .map(|i| 0x3c00 | (i % 0x3ff) as u16)
            .collect();
        let data = bytes_of(&bits);
        let shape = [3 * TILE_ELEMS as u64];
        let tensors = [TensorIn {
            name: "w",
            dtype: DType::Bf16,
            shape: &shape,
            bytes: &data,
        }];
        let model = tracing::subscriber::with_default(sub, || {
            encode_in_memory(&tensors, &EncodeConfig::default())
        })
        .unwrap();
        let log = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(
            log.contains("encoding 1 tensors") && log.contains("at enable"),
            "{log}"
        );
        assert!(log.contains("round trips checked"), "{log}");
        let dir = tmp("mem");
        write_model(&dir.join("m.opack"), &model).unwrap();
        let p = PackedCheckpoint::open(dir.join("m.opack")).unwrap();
        assert_eq!(p.decode("w", 1).unwrap(), data);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

mod ratios {
    use super::*;

    /// The reduced-width Flux (hidden 384, 1 + 2 blocks, 10 M weights):
    /// normal ≤ 0.71, Student-t ≤ 0.72, uniform shown beside them; the
    /// packed file (host memory for the masters) ≤ 0.72.
    #[test]
    fn synthetic_flux_meets_the_targets() {
        let shape = FluxShape::small();
        let cfg = EncodeConfig::default();
        let mut seen = Vec::new();
        for (law, target) in [
            (Law::Normal, 0.71),
            (Law::StudentT4, 0.72),
            (Law::Uniform, 0.71),
        ] {
            let r = pack_synthetic(&shape, law, 1, &cfg).unwrap();
            eprintln!(
                "{}: ratio {:.4}, escapes {:.2} %, codes {:?}",
                law.name(),
                r.ratio(),
                100.0 * r.escape_share(),
                r.codes()
            );
            check_ratio(law.name(), r.ratio(), target).unwrap();
            seen.push(r.ratio());
        }
        // Uniform flatters the code: its ratio is the lowest.
        assert!(seen[2] < seen[0] && seen[0] < seen[1], "{seen:?}");
    }

    /// Sampling blocks (the Flux.1-dev-sized report draws 2 of each
    /// stack) gives the full model's ratio: later blocks are twins.
    #[test]
    fn sampled_blocks_give_the_full_ratio() {
        let shape = FluxShape {
            heads: 2,
            double: 2,
            single: 2,
            joint: 128,
            ..FluxShape::small()
        };
        let cfg = EncodeConfig::default();
        let full = offload_pack::synth::pack_synthetic(&shape, Law::StudentT4, 5, &cfg).unwrap();
        let sampled =
            offload_pack::synth::pack_synthetic_sampled(&shape, Law::StudentT4, 5, &cfg, 1)
                .unwrap();
        assert_eq!(sampled.tensors.len(), full.tensors.len());
        assert_eq!(sampled.decoded_bytes(), full.decoded_bytes());
        assert!(sampled.drawn_bytes < full.drawn_bytes);
        assert!(
            (sampled.ratio() - full.ratio()).abs() < 0.001,
            "{} vs {}",
            sampled.ratio(),
            full.ratio()
        );
    }

    #[test]
    fn packed_file_is_the_host_memory() {
        let shape = FluxShape {
            single: 1,
            double: 0,
            ..FluxShape::small()
        };
        let all = shape.tensors();
        let data: Vec<Vec<u8>> = all
            .iter()
            .enumerate()
            .map(|(i, (n, s))| tensor_bytes(Law::StudentT4, 3, i, n, s, &all, 2))
            .collect();
        let tensors: Vec<TensorIn<'_>> = all
            .iter()
            .zip(&data)
            .map(|((n, s), d)| TensorIn {
                name: n,
                dtype: DType::Bf16,
                shape: s,
                bytes: d,
            })
            .collect();
        let model = encode_in_memory(&tensors, &EncodeConfig::default()).unwrap();
        let dir = std::env::temp_dir().join(format!("offload-pack-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = write_model(&dir.join("m.opack"), &model).unwrap();
        let bf16: u64 = data.iter().map(|d| d.len() as u64).sum();
        check_ratio("host memory (file / bf16)", file as f64 / bf16 as f64, 0.72).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_raw_encoder_fails_the_ratio_check() {
        // What the check says of an encoder that always picks raw.
        let shape = FluxShape {
            double: 0,
            single: 1,
            ..FluxShape::small()
        };
        let cfg = EncodeConfig {
            force: Some(Code::Raw),
            ..EncodeConfig::default()
        };
        let r = pack_synthetic(&shape, Law::Normal, 1, &cfg).unwrap();
        assert!(r.ratio() >= 1.0);
        assert!(check_ratio("raw", r.ratio(), 0.71).is_err());
    }
}

#[cfg(feature = "planted-bugs")]
mod planted {
    use super::*;
    use offload_pack::format::PlantedBug;

    fn planted(bug: PlantedBug) -> EncodeConfig {
        EncodeConfig {
            planted: Some(bug),
            ..EncodeConfig::default()
        }
    }

    #[test]
    fn always_raw_turns_the_ratio_check_red() {
        let shape = FluxShape {
            double: 0,
            single: 1,
            ..FluxShape::small()
        };
        let r = pack_synthetic(&shape, Law::Normal, 1, &planted(PlantedBug::AlwaysRaw)).unwrap();
        assert!(
            check_ratio("normal", r.ratio(), 0.71).is_err(),
            "ratio {}",
            r.ratio()
        );
    }

    #[test]
    fn an_escape_slot_off_by_one_turns_the_round_trip_red() {
        let bits: Vec<u16> = (0..2 * TILE_ELEMS as u32 + 9)
            .map(|i| {
                if i % 5 == 0 {
                    0x0001
                } else {
                    0x3c00 | (i % 0x3ff) as u16
                }
            })
            .collect();
        let e = encode_bf16_as(
            &bytes_of(&bits),
            Code::Window3 { lo: 118 },
            &planted(PlantedBug::EscapeSlotInclusive),
        )
        .unwrap_err();
        assert!(matches!(e, EncodeError::RoundTrip { .. }), "{e}");
    }

    #[test]
    fn a_window_off_by_one_costs_bytes_not_exactness() {
        let shape = FluxShape {
            double: 0,
            single: 1,
            ..FluxShape::small()
        };
        let good = pack_synthetic(&shape, Law::Normal, 1, &EncodeConfig::default()).unwrap();
        let bad =
            pack_synthetic(&shape, Law::Normal, 1, &planted(PlantedBug::WindowOffByOne)).unwrap();
        assert!(
            bad.ratio() > good.ratio() + 0.002,
            "{} vs {}",
            bad.ratio(),
            good.ratio()
        );
    }
}

mod kernel {
    use offload_pack::kernels::{DECODE_CU, DECODE_KERNEL, HOST_SHIM_H};

    #[test]
    fn the_cuda_source_names_its_kernel_and_includes_nothing() {
        assert!(DECODE_CU.contains(&format!(
            "extern \"C\" __global__ void __launch_bounds__(128) {DECODE_KERNEL}("
        )));
        assert!(
            !DECODE_CU.contains("#include"),
            "nvrtc has no system headers here"
        );
    }

    /// Where a C++ compiler exists, the kernel source parses and types
    /// against a shim of the CUDA built-ins (no CUDA toolkit here; nvrtc
    /// compiles it on the device machine).
    #[test]
    fn the_cuda_source_compiles_as_cxx_against_a_shim() {
        let Ok(cxx) = which("c++") else {
            eprintln!("skipped: no c++ compiler");
            return;
        };
        let dir = std::env::temp_dir().join(format!("offload-pack-cu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("shim.h"), HOST_SHIM_H).unwrap();
        std::fs::write(dir.join("decode.cu"), DECODE_CU).unwrap();
        let out = std::process::Command::new(cxx)
            .args([
                "-fsyntax-only",
                "-Wall",
                "-Werror",
                "-Wno-unknown-pragmas",
                "-x",
                "c++",
                "-include",
            ])
            .arg(dir.join("shim.h"))
            .arg(dir.join("decode.cu"))
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Where a C++20 compiler exists, the kernel's own source runs on the
    /// CPU (`tests/cuda_emu/emu.cc`: a std::thread per CUDA thread, block
    /// barriers for `__syncthreads` and `__shfl_up_sync`) over blobs the
    /// encoder wrote: two tensors in one launch, 16-byte aligned and
    /// misaligned outputs, a partial last tile, and a damaged tile that
    /// sets the error flag.
    #[test]
    fn the_cuda_kernel_decodes_as_the_reference_when_run_on_the_cpu() {
        use super::*;
        let Ok(cxx) = which("c++") else {
            eprintln!("skipped: no c++ compiler");
            return;
        };
        let dir = std::env::temp_dir().join(format!("offload-pack-emu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let exe = dir.join("emu");
        let built = std::process::Command::new(cxx)
            .args([
                "-std=c++20",
                "-O1",
                "-pthread",
                "-fno-strict-aliasing",
                "-o",
            ])
            .arg(&exe)
            .arg("-I")
            .arg(root.join("src"))
            .arg(root.join("tests/cuda_emu/emu.cc"))
            .output()
            .unwrap();
        if !built.status.success() {
            let err = String::from_utf8_lossy(&built.stderr);
            if err.contains("barrier") {
                eprintln!("skipped: no C++20 <barrier>: {err}");
                return;
            }
            panic!("{err}");
        }
        let bits: Vec<u16> = (0..2 * TILE_ELEMS as u32 + 77)
            .map(|i| match i % 29 {
                0 => 0x0001,
                1 => 0xff81,
                2 => 0x7f80,
                _ => 0x3c00 | (i.wrapping_mul(2_654_435_761) >> 21) as u16 & 0x7ff,
            })
            .collect();
        let data = bytes_of(&bits);
        let enc = encode_bf16_as(&data, Code::Window3 { lo: 118 }, &cfg1()).unwrap();
        assert!(enc.stats.escapes > 100);
        let run = |blob: &[u8], copies: usize, misalign: usize| -> (String, Vec<u8>) {
            std::fs::write(dir.join("blob"), blob).unwrap();
            let out = std::process::Command::new(&exe)
                .arg(dir.join("blob"))
                .arg(copies.to_string())
                .arg(misalign.to_string())
                .arg(dir.join("out"))
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            (
                String::from_utf8_lossy(&out.stdout).trim().to_owned(),
                std::fs::read(dir.join("out")).unwrap(),
            )
        };
        for misalign in [0, 1] {
            let (flag, out) = run(&enc.blob, 2, misalign);
            assert_eq!(flag, "error=0");
            assert_eq!(out.len(), 2 * data.len());
            assert_eq!(
                &out[..data.len()],
                &data[..],
                "first tensor, misalign {misalign}"
            );
            assert_eq!(
                &out[data.len()..],
                &data[..],
                "second tensor, misalign {misalign}"
            );
        }
        let mut bad = enc.blob.clone();
        let planes = 64 + 3 * 4096;
        for p in 0..3 {
            bad[planes + 512 * p] = 0;
        }
        assert_eq!(run(&bad, 1, 0).0, "error=1");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Where a C++20 compiler exists, `opk_decode_block`'s own source runs
    /// on the CPU (`tests/cuda_emu/emu_block.cc`) over a coded block the
    /// encoder wrote: window3 tensors (one with a partial last tile, one at
    /// an odd offset of the unit), a raw tensor of several 8 KiB chunks
    /// with a partial last one, raw gaps; the output 16-byte aligned, 2-byte
    /// aligned and odd; and a damaged tile that sets the error flag.
    #[test]
    fn the_block_kernel_decodes_as_the_reference_when_run_on_the_cpu() {
        use super::*;
        use offload_pack::block::{Span, encode_block};
        let Ok(cxx) = which("c++") else {
            eprintln!("skipped: no c++ compiler");
            return;
        };
        let dir =
            std::env::temp_dir().join(format!("offload-pack-emu-block-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let exe = dir.join("emu_block");
        let built = std::process::Command::new(cxx)
            .args([
                "-std=c++20",
                "-O1",
                "-pthread",
                "-fno-strict-aliasing",
                "-o",
            ])
            .arg(&exe)
            .arg("-I")
            .arg(root.join("src"))
            .arg(root.join("tests/cuda_emu/emu_block.cc"))
            .output()
            .unwrap();
        if !built.status.success() {
            let err = String::from_utf8_lossy(&built.stderr);
            if err.contains("barrier") {
                eprintln!("skipped: no C++20 <barrier>: {err}");
                return;
            }
            panic!("{err}");
        }
        let weights = |n: u32, salt: u32| -> Vec<u8> {
            let bits: Vec<u16> = (0..n)
                .map(|i| match (i + salt) % 31 {
                    0 => 0x0001,
                    1 => 0xff81,
                    _ => 0x3c00 | ((i ^ salt).wrapping_mul(2_654_435_761) >> 21) as u16 & 0x1ff,
                })
                .collect();
            bytes_of(&bits)
        };
        // [w3: 6 tiles + 77][gap 3][w3 at an odd offset: 4 tiles + 5][raw
        // f32-like: 3 chunks + 100 bytes][w3 under a tile: raw][tail 9]
        let mut unit = Vec::new();
        let mut spans = Vec::new();
        let mut push = |unit: &mut Vec<u8>, bytes: Vec<u8>, bf16: bool| {
            spans.push(Span {
                offset: unit.len() as u64,
                bytes: bytes.len() as u64,
                bf16,
            });
            unit.extend_from_slice(&bytes);
        };
        push(&mut unit, weights(6 * TILE_ELEMS as u32 + 77, 0), true);
        unit.extend_from_slice(&[1, 2, 3]);
        push(&mut unit, weights(4 * TILE_ELEMS as u32 + 5, 7), true);
        let raw: Vec<u8> = (0..3 * 8192 + 100).map(|i| (i * 7 + 3) as u8).collect();
        push(&mut unit, raw, false);
        push(&mut unit, weights(300, 3), true);
        unit.extend_from_slice(&[9u8; 9]);
        let block = encode_block(&unit, &spans, &EncodeConfig::default()).unwrap();
        assert_eq!(block.coded_spans.0, 2, "two window3 tensors");
        let run = |blob: &[u8], misalign: usize| -> (String, Vec<u8>) {
            std::fs::write(dir.join("blob"), blob).unwrap();
            let out = std::process::Command::new(&exe)
                .arg(dir.join("blob"))
                .arg(misalign.to_string())
                .arg(dir.join("out"))
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            (
                String::from_utf8_lossy(&out.stdout).trim().to_owned(),
                std::fs::read(dir.join("out")).unwrap(),
            )
        };
        for misalign in [0, 1, 2, 3, 8] {
            let (flag, out) = run(&block.blob, misalign);
            assert_eq!(flag, "error=0", "misalign {misalign}");
            assert_eq!(out.len(), unit.len());
            if let Some(at) = out.iter().zip(&unit).position(|(a, b)| a != b) {
                panic!("misalign {misalign}: the decoded unit differs at byte {at}");
            }
        }
        // Eight codes of the first tensor's first tile made escapes:
        // its escape count no longer matches the index.
        let view = offload_pack::block::BlockView::parse(&block.blob).unwrap();
        let first = view.entries()[0];
        assert_ne!(first.code, Code::Raw);
        let mut bad = block.blob.clone();
        let at = first.blob_offset as usize;
        let planes = at + u64::from_le_bytes(bad[at + 32..at + 40].try_into().unwrap()) as usize;
        for p in 0..3 {
            bad[planes + 512 * p] = 0;
        }
        assert_eq!(run(&bad, 0).0, "error=1");
        // A table entry pointing outside the unit, or a table longer than
        // the blob (stale staging bytes): refused, nothing written there.
        let mut bad = block.blob.clone();
        bad[64 + 8..64 + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert_eq!(run(&bad, 0).0, "error=2");
        let mut bad = block.blob.clone();
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let (flag, out) = run(&bad, 0);
        assert_eq!(flag, "error=2");
        assert!(
            out.iter().all(|&b| b == 0xa5),
            "a refused block writes nothing"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn which(name: &str) -> Result<std::path::PathBuf, ()> {
        std::env::var_os("PATH")
            .and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join(name))
                    .find(|p| p.is_file())
            })
            .ok_or(())
    }
}

/// A packed (`.opack`) or coded-block (`.opackb`) file whose header claims
/// offsets summing past 2^64 (eight U8 tensors of about 2^61 bytes) is a
/// typed container error naming the offsets, from both parsers, never the
/// overflow panic `safetensors` 0.8's `read_metadata` hits when it adds them
/// unchecked. Found by the `coded_blocks` fuzz target's bounded run with the
/// `safetensors_file` regression beside it (2026-12-02): both parsers
/// panicked in debug builds (`attempt to add with overflow`) until they
/// called `offload_safetensors::offsets_within` first.
#[test]
fn headers_claiming_offsets_past_2_64_are_typed_errors_in_both_containers() {
    // The fuzz regression itself (the same bytes in both targets' folders).
    let file = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../offload-fuzz/regressions/coded_blocks/offsets_past_2_64"),
    )
    .unwrap();
    assert_eq!(file.len(), 1008, "an 8-byte prefix and a 1,000-byte header");
    let dir = std::env::temp_dir().join(format!("pack-claims-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["claims.opack", "claims.opackb"] {
        let path = dir.join(name);
        std::fs::write(&path, &file).unwrap();
        let e = if name.ends_with(".opack") {
            offload_pack::container::PackedCheckpoint::open(&path)
                .map(|_| ())
                .unwrap_err()
        } else {
            offload_pack::blocks_file::CodedBlocks::open(&path)
                .map(|_| ())
                .unwrap_err()
        };
        let e = e.to_string();
        assert!(
            e.contains(name) && e.contains("data_offsets") && e.contains("t0"),
            "{name}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
