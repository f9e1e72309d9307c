import json, sys
r = json.load(open(sys.argv[1]))["tune_ksplit"]
gu = [x for x in r if x["name"].startswith("MoE gate+up")]
base = min(x["us_pdl"] for x in gu if not x["variant"]["_GU_KSPLIT"])
best = min((x for x in gu if x["variant"]["_GU_KSPLIT"]), key=lambda x: x["us_pdl"])
print(f"halves {base:.2f} us, best k-split {best['us_pdl']:.2f} us {best['variant']}", file=sys.stderr)
if best["us_pdl"] < 0.98 * base:
    v = best["variant"]
    print(f"_GU_KSPLIT=1,_RPB_GATE_UP={v['_RPB_GATE_UP']},_NW_KSPLIT={v['_NW_KSPLIT']}")
