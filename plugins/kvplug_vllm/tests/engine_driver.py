"""Runs one real vLLM engine for a test, in its own process, and prints a JSON result.

Usage: ``python engine_driver.py '<json spec>'``. The spec names the model folder,
the engine options, the ``kv_transfer_config`` (or none) and a list of steps; each
step is one ``LLM.generate`` call over its prompts. The last stdout line is
``RESULT {json}`` with every output's token ids, finish reason and
``kv_transfer_params``, and each step's wall time. A step's ``ctl_lookups`` (token lists)
are asked of the engine after its prompts by the real ``kvplug ctl lookup`` command line
(``ctl_engine``: the engine id); their replies are the step's ``ctl_lookups``. Then a step's
``ctl_clear`` (the arguments of ``kvplug ctl clear``) runs the same way; its reply is the step's
``ctl_clear``. A step's ``count_records`` (a disk or shm tier's folder) counts the chunk
records there after all that (the step's ``records``). A step's ``capture`` (a file path; the
spec's ``capture`` must be true) runs its one prompt step by step and, once the prompt is
prefilled, has every rank write what its paged caches hold for it
(:mod:`kvplug_vllm.kv_capture`, for the KV oracle); the step's ``capture`` lists the files.

A separate process per engine keeps tests isolated: vLLM keeps global state (the
KV transfer group, the distributed environment) that one process cannot reset.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path


def ctl(*args: str) -> object:
    """``kvplug ctl ARGS --json`` against this process's engine (its workers serve in the folder this
    process resolves: they run here, or in processes started from here)."""
    from kvplug import private_socket_dir
    from kvplug.testing import run_ctl

    return run_ctl(private_socket_dir(), *args)


def ctl_lookup(tokens: list[int], engine: str) -> object:
    """``kvplug ctl lookup`` of ``tokens``."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        prompt = Path(folder) / "prompt.json"
        prompt.write_text(json.dumps(tokens))
        return ctl("lookup", str(prompt), "--engine", engine)


def prompt(p: dict, model: str) -> dict:
    """vLLM's prompt for a step's prompt: its token ids, or (``embeds_seed``) embeddings drawn from
    that seed, one per token, in place of every token id or (``embeds_mask``: True keeps the id)
    of some (vLLM's mixed mode); with its ``cache_salt``."""
    out: dict = {"prompt_token_ids": p["tokens"]}
    if p.get("embeds_seed") is not None:
        import torch

        hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
        generator = torch.Generator().manual_seed(p["embeds_seed"])
        out["prompt_embeds"] = torch.randn(len(p["tokens"]), hidden, generator=generator) * 0.05
        if p.get("embeds_mask") is None:
            del out["prompt_token_ids"]
        else:
            out["prompt_is_token_ids"] = p["embeds_mask"]
    if p.get("cache_salt"):
        out["cache_salt"] = p["cache_salt"]
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tp = spec.get("tensor_parallel_size", 1)
    pp = spec.get("pipeline_parallel_size", 1)
    workers = tp * pp
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing") or workers > 1 else "0"
    if workers > 1:  # vllm-cpu binds each rank's OpenMP threads to its own cores: one core each here
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(rank % cores) for rank in range(workers)))
    from vllm import LLM, SamplingParams

    if spec.get("force_loads"):  # test_mla.py: load where kvplug would refuse, to show why it refuses
        import kvplug_vllm.scheduler

        kvplug_vllm.scheduler.load_refusal = lambda vllm_config: None

    options = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=spec.get("block_size", 32),
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=spec.get("max_model_len", 1024),
        num_gpu_blocks_override=spec.get("num_blocks", 96),
        enable_prefix_caching=spec.get("prefix_caching", False),
        seed=0,
    )
    if spec.get("mamba_cache_mode") is not None:  # a Mamba/GDN hybrid: "align" keeps states at block ends
        options["mamba_cache_mode"] = spec["mamba_cache_mode"]
    if spec.get("mamba_ssm_cache_dtype") is not None:  # the state's dtype decides vLLM's block size
        options["mamba_ssm_cache_dtype"] = spec["mamba_ssm_cache_dtype"]
    if spec.get("hf_overrides") is not None:  # the checkpoint's config overridden (test_checkpoint_keys.py)
        options["hf_overrides"] = spec["hf_overrides"]
    if spec.get("prompt_embeds"):
        options["enable_prompt_embeds"] = True
    if spec.get("max_num_batched_tokens") is not None:  # a small budget: long prompts prefill in several steps
        options["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if workers > 1:
        options.update(tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp")
    elif not spec.get("multiprocessing"):
        options["distributed_executor_backend"] = "uni"
    if pp > 1:  # with the KV capture: pipeline_worker.py says why
        from pipeline_worker import EXTENSION as PP_EXTENSION

        options["worker_extension_cls"] = PP_EXTENSION
    elif spec.get("capture"):
        from kvplug_vllm.kv_capture import EXTENSION

        options["worker_extension_cls"] = EXTENSION
    if spec.get("kv") is not None:
        options["kv_transfer_config"] = spec["kv"]
    if spec.get("kv_events") is not None:
        options["kv_events_config"] = spec["kv_events"]
    llm = LLM(**options)
    if pp > 1:
        assert any(llm.collective_rpc("kvplug_allocate_pp_buffers")), "no stage lacked its buffer: drop the workaround"
    results = []
    for step in spec["steps"]:
        if step.get("soak"):  # test_soak.py: rounds of mixed requests, kvplug's per-request state after each
            from soak_probe import soak

            results.append({"soak": soak(llm, step["soak"])})
            continue
        prompts = [prompt(p, spec["model"]) for p in step["prompts"]]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=step.get("max_tokens", 8),
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": {"kvplug.report": True, **p.get("params", {})}},
            )
            for p in step["prompts"]
        ]
        started = time.perf_counter()
        first: list[list[float]] = []
        captured: list[str] = []
        if step.get("capture"):
            outputs, captured = run_captured(llm, prompts, params, step["capture"])
            finished = []
        elif step.get("concurrent"):
            signal = step.get("signal_first_token")  # [index, path]: touched when that request has its first token
            outputs, finished, first = run_concurrently(llm, prompts, params, started, signal)
        else:
            outputs, finished = llm.generate(prompts, params, use_tqdm=False), []
        seconds = time.perf_counter() - started
        results.append(
            {
                "seconds": seconds,
                "finished": finished,
                "first_token": first,
                "capture": captured,
                "outputs": [
                    {
                        "tokens": list(o.outputs[0].token_ids),
                        "finish": o.outputs[0].finish_reason,
                        "kv": o.kv_transfer_params,
                    }
                    for o in outputs
                ],
            }
        )
        if step.get("ctl_lookups"):
            results[-1]["ctl_lookups"] = [ctl_lookup(tokens, step["ctl_engine"]) for tokens in step["ctl_lookups"]]
        if step.get("ctl_clear"):
            results[-1]["ctl_clear"] = ctl("clear", *step["ctl_clear"], "--engine", step["ctl_engine"])
        if step.get("reset_prefix_cache"):
            results[-1]["reset"] = llm.reset_prefix_cache(reset_connector=True)
        if step.get("reload_weights"):  # in place, from the model's own path (test_weights_reload.py)
            llm.collective_rpc("reload_weights")
        if step.get("touch_after"):  # tells a test's server the next step begins
            Path(step["touch_after"]).touch()
        if step.get("count_records"):
            from record_files import chunk_records

            results[-1]["records"] = len(chunk_records(Path(step["count_records"])))
    llm.llm_engine.engine_core.shutdown()  # both connector roles' shutdown()
    del llm
    gc.collect()
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print("RESULT " + json.dumps({"steps": results, "threads_after_shutdown": threads}), flush=True)


def run_captured(llm, prompts, params, path):
    """Run the one prompt step by step; once it has its first token (its prompt is in the paged
    cache, loaded or computed), every rank writes the request's KV to ``path.rank<r>``."""
    assert len(prompts) == 1, "a captured step runs one prompt"
    assert params[0].max_tokens >= 2, "a captured request must still run after its first token"
    engine = llm.llm_engine
    request_id = f"capture-{time.monotonic_ns()}"
    engine.add_request(request_id, prompts[0], params[0])
    files: list[str] = []
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not files and out.outputs and out.outputs[0].token_ids and not out.finished:
                files = llm.collective_rpc("kvplug_capture_kv", args=(path,))
            if out.finished:
                done = out
    assert done is not None and files, "the captured request finished before its KV was captured"
    return [done], files


def run_concurrently(llm, prompts, params, started, signal=None):
    """Submit every prompt at once, in order, and step the engine until all finish.

    ``signal``: ``[index, path]``: the file ``path`` is created as soon as request ``index``
    has its first token (a test's server may wait for it). Returns the outputs in submission order, ``[[index, seconds], ...]`` in the order
    the requests finished and, in the same form, in the order each got its first
    token (seconds since ``started``).
    """
    engine = llm.llm_engine
    ids = [f"c{index}-{time.monotonic_ns()}" for index in range(len(prompts))]
    for request_id, prompt, param in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, param)
    done: dict[str, object] = {}
    finished = []
    first: list[list[float]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and all(ids.index(out.request_id) != i for i, _ in first):
                first.append([ids.index(out.request_id), time.perf_counter() - started])
                if signal is not None and first[-1][0] == signal[0]:
                    Path(signal[1]).touch()
            if out.finished and out.request_id not in done:
                done[out.request_id] = out
                finished.append([ids.index(out.request_id), time.perf_counter() - started])
    return [done[request_id] for request_id in ids], finished, first


if __name__ == "__main__":
    main()
