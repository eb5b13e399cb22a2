//! libFuzzer entry point for [`offload_fuzz::packed_checkpoint`], under the allocation cap.
#![no_main]

#[global_allocator]
static ALLOC: offload_fuzz::alloc_cap::CappedAlloc = offload_fuzz::alloc_cap::CappedAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| offload_fuzz::packed_checkpoint(data));
