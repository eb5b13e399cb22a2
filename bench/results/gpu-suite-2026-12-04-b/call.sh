#!/usr/bin/env bash
# Call S18: the whole GPU suite on the session's final code (each phase's
# layout priced at the host's fills; refused pins release pages).
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B"
. ./lib.sh
gpu_suite
gpu_suite_summary
