"""One SGLang scheduler-like process for the cross-process radix test.

``store``: serve a request (its KV goes to kvplug when it finishes; closing the
tree drains the store queue to disk). ``load``: a fresh process serves the same
prompt and must get it from kvplug's disk tier. Prints one JSON line. ``serve``: build
the tree (its control socket answers), print the socket's path and wait to be killed.
"""

from __future__ import annotations

import json
import sys
import time

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_flow import build_stack, published_server_args, serve_request
from test_sglang_radix import kv_digest

from kvplug_sglang.plugin import register


def main(mode: str, model_dir: str) -> None:
    register()
    if mode == "serve":
        with published_server_args(radix_cache_backend="kvplug") as args:
            stack = build_stack(args, ModelConfig(model_dir))
            print(json.dumps({"socket": str(stack.tree.control.path)}), flush=True)
            while True:  # a scheduler's event loop, until a signal ends the process
                time.sleep(0.05)
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, ModelConfig(model_dir))
        before = stack.allocator.available_size()
        served = serve_request(stack, mode, list(range(900, 949)), seed=11 if mode == "store" else 12)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        after = stack.allocator.available_size()
        stack.tree.shutdown()
    print(
        json.dumps(
            {
                "device_hit": served.device_hit,
                "promised": served.promised,
                "loaded": served.loaded,
                "kv_sha256": kv_digest(served.kv, 48),
                "available_before": before,
                "available_after": after,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
