import json, torch, collections
e = torch.load("/tmp/proto/exact.pt"); p1, p2 = e["p1"], e["p2"]
def tv(samples, p):
    c = collections.Counter(samples); n = len(samples)
    emp = torch.zeros_like(p)
    for k, v in c.items(): emp[k] = v / n
    return 0.5 * float((emp - p).abs().sum())
for mode in ["ar", "fix", "nofix"]:
    try: t = json.load(open(f"/tmp/proto/dist_{mode}.json"))
    except FileNotFoundError: continue
    print(mode, "TV(t1)=%.4f TV(t2)=%.4f" % (tv([x[0] for x in t], p1), tv([x[1] for x in t], p2)))
