"""torchtitan 0.3.0's own mixture-of-experts models, tiny, built from torchtitan's config
classes: Qwen3-MoE (``torchtitan.models.qwen3``: ``_build_qwen3_moe_layers``,
``Qwen3Model.Config``) and DeepSeek-V3 (``torchtitan.models.deepseek_v3``:
``build_mla_moe_layers`` with DeepSeek's own inits, MLA attention, a dense first layer,
shared experts, ``ComplexRoPE`` with YaRN scaling). Weights are initialized by
torchtitan's own ``init_states`` (each module's ``param_init``) under a fixed seed.

What this module changes in torchtitan, and why (nothing else is touched):

* **Import stub.** ``torchtitan.distributed.minimal_async_ep.kernels`` imports ``triton``
  at module level (GPU kernels of one EP backend, imported by every MoE model through
  ``token_dispatcher.py``). Where ``triton`` is missing, a stub module with the eight
  kernel names ``minimal_async_ep/api.py`` imports is put into ``sys.modules`` first;
  calling one raises. These models use the ``"standard"`` dispatcher, which without an
  EP mesh is the local one and never reaches those kernels.
* **Attention.** torchtitan's language-model configs accept only flex or varlen attention
  (``get_attention_config`` rejects ``"sdpa"``); neither has a CPU backward. The layers
  are built with ``attn_backend="flex"`` and then each layer's ``inner_attention`` config
  is replaced with torchtitan's ``ScaledDotProductAttention.Config()`` (its causal
  ``is_causal=True`` default; the model is called without ``attention_masks``).
* **float64** (``float64=True``: ``model.double()``, for comparisons with one device at
  1e-9; ``float64=False`` leaves the model as torchtitan builds it, float32 with bfloat16
  experts). One computation is swapped, per instance: each ``GroupedExperts`` module's
  ``__class__`` is set to :class:`Float64Experts` (no class of torchtitan is modified).
  ``GroupedExperts.forward`` casts the routed tokens and the expert weights to bfloat16
  before each ``torch._grouped_mm`` (``x_RD.bfloat16()``, ``w1_EFD.bfloat16()``, ...) and
  the result back with ``.type_as(x_RD)``; :class:`Float64Experts` is the same forward
  without the bfloat16 casts (the ``_grouped_mm`` seam, the int32 ``cumsum`` offsets and
  the final ``type_as`` kept). Why: a bfloat16 grouped matmul rounds its output once on
  one device but once per rank's partial sum under experts-TP, and its gradients are
  bfloat16: no comparison at 1e-9 is possible. The CPU kernel of ``_grouped_mm`` has no
  float64: run the model inside ``spmd_compiler.testing.float64_grouped_mm()``.

  Left as torchtitan writes them (each rounds the same values on one device and on every
  rank, so the comparison stays exact): the combine multiplies the experts' outputs by
  the scores in float32 (``routed_output_RD.to(torch.float32) * scores``, then back;
  under experts-TP those outputs are a ``Partial`` sum, which the compiler reduces before
  the cast: issue #32 item 2, ``test_experts_tp_combine_reduces_before_its_float32_cast``);
  RoPE rotates in float32 (``query.float()``; ``ComplexRoPE``'s complex64 cache is not
  touched by ``double()``); the router's ``torch.autocast(device_type, dtype=float32)``
  around the gate is a no-op on the CPU (autocast there takes only bfloat16/float16;
  torch warns).

Load balancing as torchtitan configures it (torchtitan 0.3.0 has no auxiliary
load-balancing loss in its MoE): ``MoE.load_balance_coeff=1e-3`` (the default) gives each
MoE layer the auxiliary-loss-free bias ``expert_bias_E`` (added to the scores for the
choice of experts only) and the counter ``tokens_per_expert_E``, added to in every
training forward (``tokens_per_expert_E.add_(routing_map.sum(dim=(0, 1)))``). torchtitan
updates the bias in an optimizer step *pre-hook* (``register_moe_load_balancing_hook``,
``post_optimizer_build_fn`` of both model specs): ``coeff * sign(mean count - count)``,
centred, added to the bias; the counter zeroed. Both run inside the compiled step:
:func:`register_load_balancing` registers torchtitan's hook on a plain optimizer (traced
within ``optimizer.step()``), and :func:`balanced_step` calls the same hook function
right before ``optimizer.step()``, for the test harness, which builds its optimizers from
parameters alone. The hook's ``ParallelDims`` is a one-device stand-in (no loss mesh, so
no ``all_reduce`` of its own): the counter is a replicated buffer, so the compiled step
already sums the ranks' counts into it, as one device counts every token.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(name)
    stub.__doc__ = "CPU stand-in for torchtitan's triton kernels (tests/zoo/titan_moe.py)."
    for kernel in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                   "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                   "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        def unavailable(*args: Any, _name: str = kernel, **kwargs: Any) -> None:
            raise RuntimeError(f"{_name} needs triton (stubbed by tests/zoo/titan_moe.py)")
        setattr(stub, kernel, unavailable)
    sys.modules[name] = stub


_stub_triton_kernels()

from torchtitan.models.common import CosSinRoPE, ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers, _EMBEDDING_INIT as _DSV3_EMBEDDING_INIT  # noqa: E402
from torchtitan.models.deepseek_v3 import _NORM_INIT as _DSV3_NORM_INIT, _output_linear_init  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _EMBEDDING_INIT, _LINEAR_INIT, _qwen3_norm  # noqa: E402

__all__ = [
    "qwen3_moe", "deepseek_v3", "Float64Experts", "register_load_balancing", "update_expert_bias", "train_step", "balanced_step",
    "batches", "VOCAB", "SEQ", "BATCH",
]

VOCAB, SEQ, BATCH = 32, 8, 4


# ----------------------------------------------------------------------------- float64 swaps

class Float64Experts(GroupedExperts):
    """``GroupedExperts.forward`` without its bfloat16 casts (plain tensors only)."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offsets_E).type_as(x_RD)


def _to_float64(model: torch.nn.Module) -> torch.nn.Module:
    model.double()
    for m in model.modules():
        if type(m) is GroupedExperts:
            m.__class__ = Float64Experts
    return model


# ----------------------------------------------------------------------------- models

def _sdpa(layers: list) -> list:
    """Every layer's inner attention: torchtitan's SDPA class (causal), not flex."""
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def _build(config: Any, seed: int, float64: bool) -> torch.nn.Module:
    model = config.build()
    torch.manual_seed(seed)
    model.init_states()
    model.train()
    return _to_float64(model) if float64 else model


def qwen3_moe(*, n_layers: int = 1, dim: int = 32, num_experts: int = 4, top_k: int = 2, load_balance_coeff: float | None = 1e-3,
              float64: bool = True, seed: int = 0) -> torch.nn.Module:
    """Qwen3-MoE as ``qwen3/__init__.py``'s ``_debugmodel_moe``, tiny: 4 query heads, 2
    key/value heads of 8, qk-norm, fused wqkv, ``CosSinRoPE``, softmax router with
    ``route_norm``, ``num_experts`` experts of hidden 16, top ``top_k``."""
    head_dim = 8
    layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=16,
        num_experts=num_experts, top_k=top_k, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ * 2, theta=1000000.0),
    )
    for layer in layers:
        layer.moe.load_balance_coeff = load_balance_coeff
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_sdpa(layers),
    )
    return _build(config, seed, float64)


def deepseek_v3(*, n_layers: int = 2, n_dense_layers: int = 1, dim: int = 32, num_experts: int = 4, top_k: int = 2, load_balance_coeff: float | None = 1e-3,
                router: str = "debugmodel", float64: bool = True, seed: int = 0) -> torch.nn.Module:
    """DeepSeek-V3 as ``deepseek_v3/__init__.py``'s ``_debugmodel``, tiny: MLA (no q LoRA,
    kv LoRA rank 16, nope/rope/v head dims 8/4/8, 4 heads), the first ``n_dense_layers``
    dense (hidden 64), the rest MoE with ``num_experts`` routed experts of hidden 16 and 2 shared,
    ``ComplexRoPE`` with YaRN scaling (factor 40, mscale 0.7). ``router``: ``"debugmodel"``
    (softmax scores, as ``_debugmodel``) or ``"671B"`` (as ``_671b``: sigmoid scores,
    ``route_norm``, ``route_scale=2.5``, node-limited routing over 4 expert groups of which
    2 are chosen; give 8 experts)."""
    routing = {"router_score_func": "softmax"} if router == "debugmodel" else {
        "router_score_func": "sigmoid", "router_route_norm": True, "router_route_scale": 2.5, "router_num_expert_groups": 4,
        "router_num_limited_groups": 2}
    rope_dim = 4
    layers = _build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=n_dense_layers, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=rope_dim, v_head_dim=8, mscale=0.70, dense_hidden_dim=64, moe_hidden_dim=16, num_experts=num_experts,
        num_shared_experts=2, router_top_k=top_k, attn_backend="flex", **routing,
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=SEQ * 2, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=SEQ),
    )
    for layer in layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = load_balance_coeff
    config = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_DSV3_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_DSV3_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=_sdpa(layers), mtp_layers=[],
    )
    return _build(config, seed, float64)


# ----------------------------------------------------------------------------- training

class _OneDevice:
    """The ``ParallelDims`` the load-balancing hook reads, for one device (no meshes)."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, name: str) -> None:
        return None


class _Optimizers:
    """What ``register_moe_load_balancing_hook`` calls on torchtitan's OptimizersContainer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def register_step_pre_hook(self, hook: Any) -> None:
        self.optimizer.register_step_pre_hook(hook)


def register_load_balancing(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torchtitan's ``register_moe_load_balancing_hook`` on ``optimizer`` (a no-op for a
    model without ``load_balance_coeff``); returns ``optimizer``."""
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

    register_moe_load_balancing_hook(_Optimizers(optimizer), [model], _OneDevice())
    return optimizer


class _Captured:
    def __init__(self) -> None:
        self.hooks: list = []

    def register_step_pre_hook(self, hook: Any) -> None:
        self.hooks.append(hook)


def update_expert_bias(model: torch.nn.Module) -> None:
    """Run torchtitan's load-balancing pre-hook once on ``model`` (what
    ``register_moe_load_balancing_hook`` registers, called here directly)."""
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

    captured = _Captured()
    register_moe_load_balancing_hook(captured, [model], _OneDevice())
    for hook in captured.hooks:
        hook()


def balanced_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`train_step` with torchtitan's expert-bias update right before the optimizer
    step, where its pre-hook runs."""
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    loss.backward()
    update_expert_bias(model)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's language-model step: logits, cross-entropy over every token, backward, update."""
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def batches(n: int = 3, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(n)]
