//! libFuzzer entry point for [`offload_fuzz::coded_blocks`], under the allocation cap.
#![no_main]

#[global_allocator]
static ALLOC: offload_fuzz::alloc_cap::CappedAlloc = offload_fuzz::alloc_cap::CappedAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| offload_fuzz::coded_blocks(data));
