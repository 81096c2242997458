"""A second process for the sharing tests: `python -m tests.connectors.tier_worker JSON`.

JSON holds `config` (`KVConnectorConfig` fields) and `prompts` (token lists).
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

from tests.connectors.conftest import check_cached_pages, make_manager, run_prompt


def main(spec: dict) -> dict:
    with make_manager(total_num_pages=spec.get("total_num_pages", 64), **spec["config"]) as m:
        cached = []
        for i, tokens in enumerate(spec["prompts"]):
            c = run_prompt(m, f"w{i}", np.asarray(tokens, np.int64))
            cached.append(c.cached_prefix_length)
            m.claim("check")
            m.alloc(c_check := type(c)("check", np.asarray(tokens, np.int64)))
            m.runtime_inputs([[c_check]])
            check_cached_pages(m, "check", c_check)
            m.release("check")
        m.flush()
        metrics = {name: dataclasses.asdict(t) for name, t in m.get_tier_metrics().items()}
    return {"cached": cached, "metrics": metrics}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
