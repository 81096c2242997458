"""A second process for the sharing tests: `python -m tests.support.tier_worker JSON`.

JSON holds `config` (`KVConnectorConfig` fields), `prompts` (token lists) and
optionally `params` (`KVCacheParams` overrides).
The worker runs every prompt through its own manager (the stand-in model
writes KV where the cache had none), asserts every cached page it was served
holds its tokens' KV, flushes its saves, and prints one JSON line: the tokens
each prompt got from cache and the tier metrics.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from tests.support.tiers import admit, check_cached_pages, make_manager, run_prompt, small_params


def main(spec: dict) -> dict:
    params = small_params(**spec.get("params", {}))
    with make_manager(total_num_pages=spec.get("total_num_pages", 64), params=params, **spec["config"]) as m:
        cached = []
        for i, tokens in enumerate(spec["prompts"]):
            prompt = np.asarray(tokens, np.int64)
            cached.append(run_prompt(m, f"w{i}", prompt).cached_prefix_length)
            check = admit(m, "check", prompt)
            check_cached_pages(m, "check", check)
            m.release("check")
            print(f"done {i}", file=sys.stderr, flush=True)
        m.flush()
        metrics = {name: dataclasses.asdict(t) for name, t in m.get_tier_metrics().items()}
    return {"cached": cached, "metrics": metrics}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
