import json, sys, re, glob, os
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "planned-*.json"))):
    d = json.load(open(path))
    print(f"{os.path.basename(path)} on {d.get('device')}")
    print("| run | outside pool after enable MiB | per phase (info - pool reserved) MiB | plan mapping MiB | budget | over budget (cuMemGetInfo) MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in d["runs"]:
        p = r.get("plan") or {}
        ph = r.get("phases", [])
        per = ", ".join(f"{q['component']} {(q['info_used_peak_bytes'] - q['pool_reserved_peak_bytes']) / 2**20:.1f}" for q in ph)
        b = p.get("budget_bytes")
        over = max((q["info_used_peak_bytes"] - b for q in ph), default=0) / 2**20 if b else 0
        print(f"| {r['name']} | {r.get('outside_pool_after_enable_bytes', 0) / 2**20:.1f} | {per} | {p.get('mapping_bytes', 0) / 2**20:.1f} | {b} | {over:.1f} |")
    err = path.replace(".json", ".err")
    if os.path.exists(err):
        for line in open(err):
            if "grew by" in line or line.startswith("== "):
                print("   ", line.strip()[:260])
