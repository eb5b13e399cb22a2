//! A small seeded mutator for the bounded run in `cargo test`: no
//! coverage feedback, only the corpus mutated by one seed's choices
//! (bit flips, interesting integers, JSON/TOML tokens, splices), so the
//! same seed always runs the same inputs and a failure names its seed.

/// SplitMix64: one `u64` of state, a good enough stream for mutation.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// Integers worth writing over any eight bytes: length prefixes and
/// offsets at the edges.
const INTERESTING: [u64; 10] = [
    0,
    1,
    7,
    8,
    255,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 53,
    i64::MAX as u64,
    u64::MAX,
];

/// Pieces of the syntaxes the parsers read.
const TOKENS: [&str; 24] = [
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "\"",
    "=",
    "\n",
    ".",
    "-1",
    "0",
    "1e999",
    "18446744073709551616",
    "\"dtype\":\"F32\"",
    "\"shape\":[",
    "\"data_offsets\":[",
    "\"weight_map\":{",
    "\"__metadata__\":{",
    "\"auto\"",
    "GiB",
    "true",
    "null",
    "\\u0000",
];

/// `input` changed by one to four mutations drawn from `rng`, splicing
/// from `corpus` at times.
pub fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = out.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = rng.next_u64() as u8;
            }
            2 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let bytes = if rng.below(2) == 0 {
                    v.to_le_bytes()
                } else {
                    v.to_be_bytes()
                };
                let i = rng.below(len.saturating_sub(7).max(1));
                let end = (i + 8).min(len);
                out.splice(i..end, bytes);
            }
            3 => {
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                let i = rng.below(len + 1);
                out.splice(i..i, t.iter().copied());
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(16));
                out.drain(i..i + n);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                let chunk: Vec<u8> = out[i..i + n].to_vec();
                let at = rng.below(len + 1);
                out.splice(at..at, chunk);
            }
            6 if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                let from = rng.below(other.len() + 1);
                let to = from + rng.below(other.len() - from + 1);
                let at = rng.below(len + 1);
                out.truncate(at);
                out.extend_from_slice(&other[from..to]);
            }
            8 if len > 0 => {
                // A decimal of the input (a list index, a shape, an offset)
                // replaced by an interesting one, as libFuzzer's
                // ChangeASCIIInteger does.
                let i = rng.below(len);
                if let Some(at) = out[i..].iter().position(u8::is_ascii_digit) {
                    let from = i + at;
                    let to = from
                        + out[from..]
                            .iter()
                            .take_while(|b| b.is_ascii_digit())
                            .count();
                    let v = INTERESTING[rng.below(INTERESTING.len())].to_string();
                    out.splice(from..to, v.bytes());
                }
            }
            7 => {
                // A number somewhere turned into an interesting decimal.
                let v = INTERESTING[rng.below(INTERESTING.len())].to_string();
                let i = rng.below(len + 1);
                out.splice(i..i, v.bytes());
            }
            _ => {}
        }
    }
    out
}
