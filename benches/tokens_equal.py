"""Compares each decode-builds run's tokens with a baseline build's: `python3 benches/tokens_equal.py BUILD`
(OUT: the runs' folder). Prints, run by run, the requests whose tokens are equal and where each first parts."""
import json,sys,glob,os
out=os.environ.get("OUT","/tmp/kvplan-gpu")
base=sys.argv[1]
for f in sorted(glob.glob(f"{out}/builds-*.jsonl")):
    name=os.path.basename(f)[7:-6]
    b,spec,bs=name.rsplit("-",2)
    if b==base: continue
    ref=f"{out}/builds-{base}-{spec}-{bs}.jsonl"
    if not os.path.exists(ref): continue
    A=[json.loads(l)["tokens"] for l in open(ref) if l.strip()]
    B=[json.loads(l)["tokens"] for l in open(f) if l.strip()]
    eq=sum(a==b for a,b in zip(A,B))
    pre=[next((i for i,(x,y) in enumerate(zip(a,b)) if x!=y),len(a)) for a,b in zip(A,B)]
    print(name,"vs",base,f"equal {eq}/{len(A)}","first diff",pre)
