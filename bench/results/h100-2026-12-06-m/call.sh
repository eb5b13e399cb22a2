#!/usr/bin/env bash
# Call M (2026-12-06, twelfth session; offload-bench built at 8ac9910, on the
# machine call L left warm): "none" against "auto" at 4,608 tokens, where
# the copies are exposed and "auto" should code.
mkdir -p $OUT/a4608; timeout 200 .bundle/offload-bench --tokens 4608 --depths "" --weight-compression none,auto --steps 3 --warmup 1 --no-simulate --json $OUT/a4608/auto.json >$OUT/a4608/auto.log 2>$OUT/a4608/auto.err; echo rc $?; grep -A4 "^Default layerwise at the chooser" $OUT/a4608/auto.log | tail -2; grep -E "weight_compression|host→device" $OUT/a4608/auto.err | cut -c1-300 | head -4; gzip $OUT/a4608/*
