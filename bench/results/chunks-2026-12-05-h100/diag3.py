import json, sys, glob, os
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "**", "planned-*.json"), recursive=True)) + sorted(glob.glob(os.path.join(out, "planted*.json"))):
    d = json.load(open(path))
    print(f"{os.path.relpath(path, out)} on {d.get('device')}")
    print("| run | plan slack MiB | plan mappings MiB | outside pool after enable MiB | largest phase: pool used / reserved MiB | budget − cuMemGetInfo peak, MiB (worst phase) | output = resident |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in d["runs"]:
        inp = r.get("inputs") or {}
        ph = r.get("phases", [])
        if not ph:
            print(f"| {r['name']} | – | – | – | – | – | {r.get('output_equals_resident')} |")
            continue
        b = ph[0]["budget_bytes"]
        if b is None: continue
        big = max(ph, key=lambda q: q["pool_used_peak_bytes"])
        worst = min(b - q["info_used_peak_bytes"] for q in ph)
        print(f"| {r['name']} | {inp.get('allocator_slack_bytes', 0)/2**20:.1f} | {inp.get('mapping_bytes', 0)/2**20:.2f} | {r.get('outside_pool_after_enable_bytes', 0)/2**20:.1f} | {big['pool_used_peak_bytes']/2**20:.1f} / {big['pool_reserved_peak_bytes']/2**20:.1f} | {worst/2**20:.1f} | {r.get('output_equals_resident')} |")
