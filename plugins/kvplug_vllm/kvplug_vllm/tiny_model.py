"""A random-weight Llama (or DeepSeek-V2 style MLA, or Qwen3-Next style GDN hybrid model) written to a folder, for demos, tests and benchmarks.

vLLM loads it like any Hugging Face checkpoint (``config.json`` +
``model.safetensors``); no tokenizer and no download are needed, so prompts are
given as token ids and the engine runs with ``skip_tokenizer_init=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the random Llama; the defaults make a 3 MB model that runs in milliseconds."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1000
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0
    #: Per layer ``"full_attention"`` or ``"sliding_attention"`` (vLLM's Llama reads them);
    #: None: every layer is full attention.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    #: The std of the random weights; a larger one (e.g. 0.3) gives a model whose greedy tokens vary.
    initializer_range: float = 0.02
    #: Weights whose greedy tokens vary and depend on the whole prompt, through the KV: a plain
    #: random model answers one token over and over (its attention averages the prompt away), so
    #: "outputs identical" would prove little. See :func:`_vary_outputs`.
    varied_outputs: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameters of the model (embeddings and LM head counted once each)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return self.num_hidden_layers * per_layer + 2 * v * h + h


#: About 100M parameters: the size the vLLM benchmark uses.
BENCH_SPEC = TinyLlamaSpec(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=16000,
    max_position_embeddings=9216,
)


#: The default tiny model (2 layers, hidden 256).
DEFAULT_SPEC = TinyLlamaSpec()


def write_random_llama(path: str | Path, spec: TinyLlamaSpec = DEFAULT_SPEC) -> Path:
    """Write a random Llama checkpoint to ``path`` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, spec.dtype)
    fields = {k: v for k, v in _config_fields(spec).items() if v is not None}
    if spec.layer_types is not None:
        fields["layer_types"] = list(spec.layer_types)
    config = LlamaConfig(**fields, torch_dtype=dtype, eos_token_id=2, bos_token_id=1)
    adjust = _vary_outputs if spec.varied_outputs else None
    return _save_seeded(LlamaForCausalLM, config, dtype, spec.seed, path, adjust)


def _vary_outputs(model: Any) -> None:
    """Embeddings of std 1 with the LM head a permutation of them (the residual stream then names
    a next token with a wide margin), and sharp attention (queries and keys of std 0.3) that
    moves it by what the prompt's KV holds: greedy tokens vary, two prompts ending in the same
    token continue differently, and top-2 logit gaps stay far above bf16's rounding."""
    import torch

    generator = torch.Generator().manual_seed(123)
    embeddings = torch.randn(model.model.embed_tokens.weight.shape, generator=generator)
    model.model.embed_tokens.weight.copy_(embeddings)
    model.lm_head.weight.copy_(embeddings[torch.randperm(embeddings.shape[0], generator=generator)])
    for layer in model.model.layers:
        attention = layer.self_attn
        for projection, std in ((attention.q_proj, 0.3), (attention.k_proj, 0.3), (attention.v_proj, 0.1), (attention.o_proj, 0.1)):  # fmt: skip
            projection.weight.copy_(torch.randn(projection.weight.shape, generator=generator) * std)


def _config_fields(spec: Any, *skip: str) -> dict[str, Any]:
    """The fields of a tiny model spec that go into the model's config as they are."""
    return {k: v for k, v in asdict(spec).items() if k not in ("dtype", "seed", "varied_outputs", *skip)}


def _save_seeded(
    model_class: Any,
    config: Any,
    dtype: Any,
    seed: int,
    path: str | Path,
    adjust: Callable[[Any], None] | None = None,
) -> Path:
    """Initialise ``model_class(config)`` from ``seed`` (leaving the caller's RNG as it was),
    let ``adjust`` change its weights, cast it to ``dtype`` and save it to ``path`` (created)."""
    import torch

    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config)
        if adjust is not None:
            with torch.no_grad():
                adjust(model)
        model = model.to(dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(target)
    return target


@dataclass(frozen=True)
class TinyDeepseekV2Spec:
    """Shape of a random DeepSeek-V2 style model (MLA attention, dense MLPs only).

    vLLM's CPU MLA kernel only runs a 576-wide latent cache: ``kv_lora_rank`` 512 plus
    ``qk_rope_head_dim`` 64, as in DeepSeek-V2/V3. Every layer is dense
    (``first_k_dense_replace`` = layers) so no MoE kernel is needed.
    """

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    vocab_size: int = 1000
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    dtype: str = "bfloat16"
    seed: int = 0


#: The default tiny MLA model (2 layers, hidden 256, latent 512 + rope 64).
DEFAULT_DEEPSEEK_V2_SPEC = TinyDeepseekV2Spec()


def write_random_deepseek_v2(path: str | Path, spec: TinyDeepseekV2Spec = DEFAULT_DEEPSEEK_V2_SPEC) -> Path:
    """Write a random DeepSeek-V2 style (MLA) checkpoint to ``path`` (created) and return it."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    dtype = getattr(torch, spec.dtype)
    fields = _config_fields(spec)
    config = DeepseekV2Config(
        **fields,
        num_key_value_heads=spec.num_attention_heads,
        head_dim=spec.qk_rope_head_dim,
        q_lora_rank=None,
        first_k_dense_replace=spec.num_hidden_layers,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        torch_dtype=dtype,
        eos_token_id=2,
        bos_token_id=1,
    )
    return _save_seeded(DeepseekV2ForCausalLM, config, dtype, spec.seed, path)


@dataclass(frozen=True)
class TinyQwen3NextSpec:
    """Shape of a random Qwen3-Next style hybrid: Gated DeltaNet (linear attention) layers
    with full-attention ones; the last layer has a small MoE (vLLM looks for one), the others dense MLPs."""

    hidden_size: int = 256
    intermediate_size: int = 512
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention")
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    #: vLLM's CPU Gated DeltaNet kernel runs head dim 128 (32: "Unexpected head dim size").
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    vocab_size: int = 1000
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0
    #: Fill every GDN layer's ``A_log`` with this (None: the random init). The delta rule decays
    #: its state by ``exp(-exp(A_log) * softplus(...))`` per token: random ``A_log`` forgets the
    #: prompt within a few tokens, so a test of a restored state needs a long memory (e.g. -8).
    a_log: float | None = None


#: The default tiny GDN hybrid (one Gated DeltaNet layer, one full-attention layer).
DEFAULT_QWEN3_NEXT_SPEC = TinyQwen3NextSpec()


def write_random_qwen3_next(path: str | Path, spec: TinyQwen3NextSpec = DEFAULT_QWEN3_NEXT_SPEC) -> Path:
    """Write a random Qwen3-Next style (GDN + full attention) checkpoint to ``path`` and return it."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    dtype = getattr(torch, spec.dtype)
    fields = _config_fields(spec, "layer_types", "a_log")
    layers = len(spec.layer_types)

    def long_memory(model: Any) -> None:
        for name, parameter in model.named_parameters():
            if spec.a_log is not None and name.endswith("A_log"):
                parameter.fill_(spec.a_log)

    config = Qwen3NextConfig(
        **fields,
        num_hidden_layers=layers,
        layer_types=list(spec.layer_types),
        mlp_only_layers=list(range(layers - 1)),  # vLLM wants one MoE layer; the others dense
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        torch_dtype=dtype,
        eos_token_id=2,
        bos_token_id=1,
    )
    return _save_seeded(Qwen3NextForCausalLM, config, dtype, spec.seed, path, long_memory)


@dataclass(frozen=True)
class TinyGptOssSpec:
    """Shape of a random gpt-oss style model: sliding-window (with attention sinks) and full
    attention layers in turn, MoE MLPs. ``initializer_range`` 0.1: the library default
    (0.02) makes a random model of this size repeat one token."""

    hidden_size: int = 256
    intermediate_size: int = 256
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention")
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    sliding_window: int = 128
    vocab_size: int = 1000
    max_position_embeddings: int = 4096
    initializer_range: float = 0.1
    dtype: str = "bfloat16"
    seed: int = 0


#: The default tiny gpt-oss style model (one sliding layer with sinks, one full, MoE MLPs).
DEFAULT_GPT_OSS_SPEC = TinyGptOssSpec()


def write_random_gpt_oss(path: str | Path, spec: TinyGptOssSpec = DEFAULT_GPT_OSS_SPEC) -> Path:
    """Write a random gpt-oss style checkpoint to ``path`` and return it."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    dtype = getattr(torch, spec.dtype)
    fields = _config_fields(spec, "layer_types")
    config = GptOssConfig(
        **fields,
        num_hidden_layers=len(spec.layer_types),
        layer_types=list(spec.layer_types),
        torch_dtype=dtype,
        eos_token_id=2,
        bos_token_id=1,
    )
    return _save_seeded(GptOssForCausalLM, config, dtype, spec.seed, path)
