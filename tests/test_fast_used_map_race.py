"""A rebuild of the fast tier's used-range map that a commit overtakes (its listing taken
before the commit's manifest existed) must not install a map without that checkpoint's
ranges: the next save would reserve, and overwrite, the bytes of a retained checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from fast_support import cfg, make_state, roots, train, overlapping
import gpusnap


def test_rebuild_racing_a_commit_drops_its_ranges(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0, width=128, extra=200_000)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg(), fast_keep_last=5) as ck:
        ck.save(state).wait()
        tier = ck._tiers.fast()
        tier._forget_used()  # what delete()/retention leave
        orig = tier._scan
        box = {}
        def scan(*a, **k):
            if box.get("done"):
                return orig(*a, **k)
            box["done"] = True
            got = orig(*a, **k)            # listing taken ...
            train(state, 1)
            t = threading.Thread(target=lambda: box.setdefault("b", ck.save(state).wait()))
            t.start(); t.join()            # ... a save commits meanwhile
            return got
        tier._scan = scan
        tier._used_map()                   # e.g. another save's _reserve / a _named()
        tier._scan = orig
        b = box["b"]
        mb = tier.load_manifest(b.id)
        used = tier._used_map()
        named = [(int(x.split("@")[1].split(":")[0]), int(x.split(":")[1]), int(x.split(":")[2]))
                 for st in mb.storages for x in st.chunks]
        assert all(any(lo <= o and o + n <= hi for lo, hi in used.get(slab, ())) for slab, o, n in named)
        train(state, 2)
        c = ck.save(state).wait()
        mc = tier.load_manifest(c.id)
        assert not overlapping(mc, [mb])
