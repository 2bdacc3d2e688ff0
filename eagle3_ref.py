"""
eagle3_ref.py: a single-file reference implementation of EAGLE-3 speculative decoding
(Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test").

Part I, the method, reads top to bottom in the order of the paper, for one sequence on a
dense (Llama-family) target; Part II holds the variants a learner can skip and what running
the method needs, and nothing in Part I calls it. The workbench and the live engines stand
beside this file in modules of their own; this file stands alone.

    Part I, the method:
       1. constants and configs                 6. draft head
       2. argument checks and bookkeeping       7. draft tree
       3. distributed helpers                   8. verify and accept
       4. target model (dense)                  9. generation
       5. tensor parallelism                   10. training-time test
    Part II, sections 11-23: launch, baselines, variants (sampled chain, SGLang, vLLM, batch,
    DeepSeek-V3 / Kimi, exact bf16), IO, training, tiny models, golden traces, demo, CLI.

Symbols used in shapes and comments:
    B batch, T time (sequence), S cache length, D hidden size, V vocab (target),
    Vd draft vocab, H query heads, Hkv key/value heads, hs head size, I MLP width,
    L target layers, W world size (tensor-parallel ranks), N tree nodes (root included),
    K top-k per tree level, n accepted prefix length (tokens already in the KV cache).

Launch lines:
    python eagle3_ref.py                          # tiny end-to-end demo on a CPU
    torchrun --nproc_per_node=2 eagle3_ref.py     # the same, tensor parallel (gloo on CPU)
    python eagle3_ref.py golden --out runs/trace.safetensors   # a golden trace (tiny models)
    torchrun --nproc_per_node=8 eagle3_ref.py generate --chat --prompt "Hello"
        --target ~/models/Llama-3.1-8B-Instruct
        --draft ~/models/EAGLE3-LLaMA3.1-Instruct-8B      # (one line) real checkpoints, NCCL
"""
import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ========================================================================================
#
#   PART I: THE METHOD
#
# ========================================================================================

# ----------------------------------------------------------------------------------------
# 1. constants and configs

MIN_LAYERS_FOR_AUX = 7      # aux layers (2, L//2, L-3) are distinct only for L >= 7
# the official dynamic tree (EaModel.from_pretrained defaults)
TOP_K = 10                  # children per expanded node, and nodes expanded per level
DEPTH = 7                   # draft passes after the first level: depth+1 drafted levels
TOTAL_TOKENS = 60           # tree size the target verifies, root included
# training-time test (official traineagle3)
TTT_STEPS = 7               # unrolled draft steps per position
TTT_DECAY = 0.8             # step k weighs 0.8**k: the first drafted tokens matter most


class Eagle3Error(ValueError):
    """A wrong input: the message names the value, what was expected and the fix."""


def fail(message):
    raise Eagle3Error(message)


@dataclass
class TargetConfig:
    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    qkv_bias: bool             # qwen2 has q/k/v biases
    qk_norm: bool              # qwen3 RMS-normalises q and k per head before RoPE
    tie_embeddings: bool
    max_positions: int         # KV cache length limit (max_position_embeddings / window)
    inv_freq: torch.Tensor     # (hs/2,) RoPE inverse frequencies, exactly as transformers
    rope_scale: float          # transformers' "attention scaling" applied to cos/sin (yarn)
    mla: "MLAConfig" = None    # deepseek_v3: multi-head latent attention instead of GQA
    moe: "MoEConfig" = None    # deepseek_v3: routed + shared experts after the dense layers

    @property
    def default_aux_layers(self):
        # EAGLE-3 fuses the residual stream *entering* a low, a middle and a high layer
        # (= transformers hidden_states[2], [L//2], [L-3]).
        L = self.n_layers
        return (2, L // 2, L - 3)


@dataclass
class DraftConfig:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    vocab_size: int            # the target's vocab V: the drafter embeds target ids
    draft_vocab_size: int      # Vd: rows of the draft lm_head
    target_hidden_size: int    # fc maps 3 * target_hidden_size -> hidden_size
    aux_layers: tuple          # target layers whose *input* residual is fused (input ids)
    aux_default: bool          # aux_layers are the target's (2, L//2, L-3): saved without ids
    has_vocab_map: bool        # d2t/t2d buffers present (else draft ids are target ids)
    inv_freq: torch.Tensor
    rope_scale: float
    raw: dict                  # config.json as read, rewritten on save


# ----------------------------------------------------------------------------------------
# 2. argument checks and bookkeeping                                  (a learner can skip this)
#
# What the method keeps beside it, gathered so that it does not interrupt sections 3-10:
# checks that turn a wrong argument into one line naming it, the tally of what tensor
# parallelism sends, and the record of the uniforms a round drew (the replay contract:
# another implementation handed the same uniforms must make the same choices).


def check_aux_layers(aux_layers, n_layers):
    if len(set(aux_layers)) != 3 or not all(0 <= i <= n_layers for i in aux_layers):
        fail(f"aux layers {tuple(aux_layers)} for a {n_layers}-layer target must be 3 distinct "
             f"ids in 0..{n_layers}; the default (2, L//2, L-3) needs "
             f"num_hidden_layers >= {MIN_LAYERS_FOR_AUX}")


def check_token_ids(ids, vocab_size):
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        fail(f"input_ids holds token id {bad}, outside the target vocab [0, {vocab_size}): "
             f"the prompt was encoded for another model, or is not a token-id tensor")


def check_tree_shape(shape, draft_vocab_size):
    for name, value in zip(shape._fields, shape):  # depth 0: the root's children alone;
        least = dict(depth=0, total_tokens=2).get(name, 1)   # 2 tokens: the root and a draft
        if not isinstance(value, int) or value < least:
            fail(f"{name}={value!r} must be an integer >= {least}")
    top_k, depth, total_tokens = shape
    if top_k > draft_vocab_size:
        fail(f"top_k={top_k} exceeds the drafter's vocabulary of {draft_vocab_size} tokens; "
             f"use top_k <= {draft_vocab_size}")
    pool = top_k + depth * top_k ** 2
    if total_tokens - 1 > pool:
        fail(f"total_tokens={total_tokens} cannot be built with top_k={top_k}, depth={depth}: "
             f"at most top_k + depth*top_k^2 + 1 = {pool + 1} nodes exist")


def check_sampling(s):
    if not isinstance(s.temperature, (int, float)) or s.temperature < 0:
        fail(f"temperature={s.temperature!r} must be >= 0 (0 = greedy)")
    if not 0 < s.top_p <= 1:
        fail(f"top_p={s.top_p!r} must be in (0, 1] (1 = off)")
    if not isinstance(s.top_k, int) or s.top_k < 0:
        fail(f"top_k={s.top_k!r} must be an integer >= 0 (0 = off)")


def eos_list(eos_token_id):
    """None, one id, or several (Llama-3 lists more than one) -> a list of ids."""
    if eos_token_id is None:
        return []
    return list(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]


def check_eos(eos_token_id, vocab_size):
    for t in eos_list(eos_token_id):
        if t is not None and (not isinstance(t, int) or not 0 <= t < vocab_size):
            fail(f"eos_token_id={t!r} is not a token id of the target vocab [0, {vocab_size})")


def check_generation_args(input_ids, max_new_tokens, capacity, vocab_size, reserve=0):
    if isinstance(input_ids, torch.Tensor) and input_ids.numel() == 0:
        fail(f"the prompt is empty (input_ids of shape {tuple(input_ids.shape)}); give at "
             f"least one token")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        fail(f"input_ids must be a torch.long tensor of token ids, got "
             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        fail(f"input_ids must have shape (1, T) (batch size 1), got {tuple(input_ids.shape)}")
    check_token_ids(input_ids, vocab_size)
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        fail(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    need = input_ids.shape[1] + max_new_tokens + reserve
    if need > capacity:
        fail(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens})"
             f"{f' + tree ({reserve})' if reserve else ''} = {need} exceeds the cache length "
             f"{capacity} (max_position_embeddings or sliding window); shorten one of them")


def check_dtypes(target, draft):
    """The drafter reads the target's features: one dtype for both (a stand-in without fc
    weights, an oracle, is not checked)."""
    t = target.lm_head.weight.dtype
    d = getattr(getattr(draft, "fc", None), "weight", torch.empty(0, dtype=t)).dtype
    if t != d:
        fail(f"the drafter's weights are {str(d)[6:]} but the target's are {str(t)[6:]}; "
             f"load the drafter in the target's dtype (load_draft(path, target, "
             f"dtype={t}) or draft.to({t}))")


def check_run(target, draft, prompts, max_new_tokens, sampling, shape, eos_token_id, variant):
    """Every argument of speculative decoding, checked before any work."""
    check_sampling(sampling)
    if variant:
        variant.check(sampling)
    check_tree_shape(shape, draft.cfg.draft_vocab_size)
    check_dtypes(target, draft)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        fail("prompts must be a non-empty list of (1, T) token-id tensors")
    check_eos(eos_token_id, target.cfg.vocab_size)
    for ids in prompts:
        check_generation_args(ids, max_new_tokens, target.cfg.max_positions,
                              target.cfg.vocab_size, reserve=shape.total_tokens)


class Tally(NamedTuple):
    """The collectives sent through a group: calls and payload bytes per op."""
    calls: Counter
    bytes: Counter

    def add(self, op, x):
        self.calls[op] += 1
        self.bytes[op] += x.numel() * x.element_size()

    def copy(self):
        return Tally(Counter(self.calls), Counter(self.bytes))

    def since(self, mark):
        """What was sent after `mark` (an earlier copy of this tally)."""
        return Tally(self.calls - mark.calls, self.bytes - mark.bytes)


def uniform_stream(generator):
    """Uniforms in [0, 1) drawn one at a time (float64) from a sequence's seeded CPU
    generator, its `randomness` (the engines' schemes draw their tensors from it)."""
    while True:
        yield float(torch.rand((), generator=generator, dtype=torch.float64))


class Recorder:
    """Draws uniforms from a stream, keeping each in order: a round reports the coins it used."""

    def __init__(self, stream):
        self.stream, self.used = stream, []

    def draw(self):
        u = next(self.stream)
        self.used.append(u)
        return u


# ----------------------------------------------------------------------------------------
# 3. distributed helpers
#
# Tensor parallelism (TP) runs one process per device under torchrun (the process group is
# joined at launch by init_distributed, with the tools). Every rank holds a slice of every big
# weight; the only communication of the forward pass is one all_reduce after each
# row-parallel matmul. Without torchrun every group has size W = 1 and sends nothing.


class Group(NamedTuple):
    """The tensor-parallel group as the collectives see it: its size W, a tally of what
    they sent, and how it sums a tensor over the ranks in place. Each target has its own."""
    size: int
    sent: Tally
    reduce: object = None  # None: dist.all_reduce; the exact path (Part II) may fix the order


def new_group(size):
    return Group(size, Tally(Counter(), Counter()))


LOCAL = new_group(1)  # no tensor parallelism: the drafter, replicated on every rank


def all_reduce(x, group):
    """Sum the partial results of a row-parallel matmul over the W ranks holding slices."""
    if group.size > 1:
        group.sent.add("all_reduce", x)
        (group.reduce or dist.all_reduce)(x)
    return x


def broadcast0(x, group):
    """Rank 0's tensor on every rank: decisions (tokens, accepted paths) are made once."""
    if group.size > 1:
        group.sent.add("broadcast", x)
        dist.broadcast(x, src=0)
    return x


# ----------------------------------------------------------------------------------------
# 4. target model
#
# A plain Llama-style decoder written for one process. TP only changes the *local* sizes
# (H/W heads, Hkv/W kv heads, I/W MLP width) and adds the two all_reduce lines.


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in fp32, cast back, then scale: the order transformers (and EAGLE) use.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(inv_freq, positions, scale, dtype):
    """cos/sin tables for integer positions (T,) (or (B, T), one row per sequence),
    computed in fp32 like transformers, with a head axis to broadcast over."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)       # (.., T, hs/2)
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-3)                    # (.., 1, T, hs)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x, cos, sin):
    # Non-interleaved "rotate half" convention: pairs (i, i + hs/2) rotate together.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)                  # (.., hs)
    return x * cos + rotated * sin


def prefix_mask(n, local):
    """(T, n + T') bool: the n cached prefix slots are fully visible, then `local` (T, T')
    says which of the new slots each new token sees (causal, or tree ancestors)."""
    visible = torch.ones(local.shape[0], n, dtype=torch.bool, device=local.device)
    return torch.cat([visible, local], dim=1)                                     # (T, n+T')


def causal_mask(T, start, device):
    """(T, start + T) bool: the cached prefix is fully visible, new tokens are causal."""
    return prefix_mask(start, torch.ones(T, T, dtype=torch.bool, device=device).tril())


def attention_bias(mask, dtype):
    """bool mask (T, S) (or (B, T, S)), True = may attend -> additive bias (B or 1, 1, T, S),
    built once per forward. Four axes, not three: torch's CPU SDPA takes a 3-D mask down its
    unfused path (a sixth of the tiny demo's decode step, a fifth of its 60-node verify)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
    return bias.view(-1, 1, *mask.shape[-2:])                            # (B or 1, 1, T, S)


def attend(q, k, v, bias, scale=None):
    """Softmax attention of q (B, H, T, hs) over k, v (B, Hkv, S, hs) with an additive
    bias (B or 1, 1, T, S), scores scaled by `scale` (default hs^-0.5). Query head h reads
    kv head h // (H / Hkv) (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                          enable_gqa=True)


def cache_append(kv, start, a, b):
    """Write a, b (B, heads, T, .) at slots start..start+T-1 of the cache slabs kv = (A, B)
    and return slots 0..start+T-1 of both; without slabs, a and b themselves."""
    if kv is None:
        return a, b
    end = start + a.shape[2]
    kv[0][:, :, start:end], kv[1][:, :, start:end] = a, b
    return kv[0][:, :, :end], kv[1][:, :, :end]                                 # (B, ., S, .)


class KVCache(NamedTuple):
    """Preallocated keys and values, one slab per layer; callers pass the valid length."""
    k: torch.Tensor  # (L, B, Hkv/W, S, hs)
    v: torch.Tensor  # (L, B, Hkv/W, S, hs)


def new_kv_cache(n_layers, n_kv_heads, head_dim, length, dtype, device, batch=1):
    shape = (n_layers, batch, n_kv_heads, length, head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


class Attention(nn.Module):
    def __init__(self, cfg, tp, in_dim=None, qkv_bias=False, qk_norm=False):
        super().__init__()
        self.tp = tp  # a group of one for the replicated drafter, even under torchrun
        self.H, self.Hkv, self.hs = cfg.n_heads // tp.size, cfg.n_kv_heads // tp.size, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        # column-parallel: each rank owns H/W query heads and Hkv/W kv heads
        self.q_proj = nn.Linear(in_dim, self.H * self.hs, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, self.Hkv * self.hs, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, self.Hkv * self.hs, bias=qkv_bias)
        # row-parallel: each rank owns the input columns of its heads
        self.o_proj = nn.Linear(self.H * self.hs, cfg.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.hs, cfg.rms_eps)
            self.k_norm = RMSNorm(self.hs, cfg.rms_eps)
        self.qk_norm = qk_norm
        self.attend = attend  # the attention core; make_exact (Part II) swaps in a per-row one

    def project(self, x, cos, sin):
        """x (B, T, in) -> q (B, H, T, hs), k and v (B, Hkv, T, hs), RoPE applied."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hs)                   # (B, T, H, hs)
        k = self.k_proj(x).view(B, T, self.Hkv, self.hs)                 # (B, T, Hkv, hs)
        v = self.v_proj(x).view(B, T, self.Hkv, self.hs).transpose(1, 2)  # (B, Hkv, T, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)                      # (B, H, T, hs)
        k = apply_rope(k.transpose(1, 2), cos, sin)                      # (B, Hkv, T, hs)
        return q, k, v

    def output(self, y):
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).reshape(B, T, self.H * self.hs)          # (B, T, H*hs)
        return all_reduce(self.o_proj(y), self.tp)  # row-parallel: sum the partials

    def forward(self, x, cos, sin, bias, kv=None, start=0):
        q, k, v = self.project(x, cos, sin)
        k, v = cache_append(kv, start, k, v)                               # (B, Hkv, S, hs)
        return self.output(self.attend(q, k, v, bias))


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, tp):
        super().__init__()
        I = intermediate_size // tp.size
        self.tp = tp
        self.gate_proj = nn.Linear(hidden_size, I, bias=False)  # column-parallel
        self.up_proj = nn.Linear(hidden_size, I, bias=False)    # column-parallel
        self.down_proj = nn.Linear(I, hidden_size, bias=False)  # row-parallel

    def partial(self, x):
        """This rank's share of the output: the W shares sum to the full SwiGLU."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        return all_reduce(self.partial(x), self.tp)


class Block(nn.Module):
    """One decoder layer around the residual stream. Its attention and MLP are handed in by
    the model: the Llama family's above, or a variant's (DeepSeek-V3: MLA and MoE)."""

    def __init__(self, cfg, self_attn, mlp):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, bias, kv=None, start=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bias, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Target(nn.Module):
    """The target LLM. Parameter names are exactly the Hugging Face checkpoint keys, so
    loading is a strict key-for-key copy. Embedding and lm_head are replicated; every rank
    ends with identical full logits. `self.tp` is this model's tensor-parallel group."""

    def __init__(self, cfg, world=1):
        super().__init__()
        self.cfg, self.tp = cfg, new_group(world)
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg, self.attention(i), self.mlp(i))
                                 for i in range(cfg.n_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_eps)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention(self, layer):
        """Layer `layer`'s attention module: grouped-query attention (a variant overrides)."""
        return Attention(self.cfg, self.tp, qkv_bias=self.cfg.qkv_bias, qk_norm=self.cfg.qk_norm)

    def mlp(self, layer):
        return MLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.tp)

    def new_cache(self, length, batch=1):
        cfg, p = self.cfg, self.lm_head.weight
        return new_kv_cache(cfg.n_layers, cfg.n_kv_heads // self.tp.size, cfg.head_dim, length,
                            p.dtype, p.device, batch)

    def forward(self, input_ids, positions=None, mask=None, cache=None, start=0, aux_layers=None):
        """input_ids (B, T) at `positions` (default start..start+T-1), attending to `mask`
        (T, start+T) bool (default causal); rows of their own lengths pass positions (B, T)
        and masks (B, T, S). With a cache, K/V go to slots start.. after a `start`-slot prefix.
        -> logits (B, T, V), aux (B, T, 3*D): the residual stream entering each of
        `aux_layers` (default 2, L//2, L-3; L = the final pre-norm state; () -> aux None)."""
        B, T = input_ids.shape
        if aux_layers is None:
            aux_layers = self.cfg.default_aux_layers
            check_aux_layers(aux_layers, self.cfg.n_layers)
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device)
        if mask is None:
            mask = causal_mask(T, start, input_ids.device)
        x = self.model.embed_tokens(input_ids)                              # (B, T, D)
        cos, sin = rope_cos_sin(self.cfg.inv_freq, positions, self.cfg.rope_scale, x.dtype)
        bias = attention_bias(mask, x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                captured[i] = x
            kv = None if cache is None else tuple(slab[i] for slab in cache)
            x = layer(x, cos, sin, bias, kv, start)
        captured[self.cfg.n_layers] = x
        aux = None if not aux_layers else torch.cat([captured[i] for i in aux_layers], -1)
        return self.lm_head(self.model.norm(x)), aux              # (B, T, V), (B, T, 3D)


# ----------------------------------------------------------------------------------------
# 5. tensor parallelism: which dimension of a checkpoint tensor each rank slices
#
#   column-parallel (dim 0, output rows): q/k/v_proj, gate/up_proj (weights and biases);
#                                         MLA's q_b_proj / q_proj and kv_b_proj, by head;
#                                         every expert's and the shared experts' gate/up
#   row-parallel    (dim 1, input cols):  o_proj, down_proj (experts' too)
#   replicated:                           embeddings, norms, lm_head, MLA's q_a_proj and
#                                         kv_a_proj_with_mqa, the MoE router
#
# The loader (shard_dim, section 17) reads only this rank's slice of each tensor (sizes must
# divide by W, checked once, at load); the model above runs unchanged on the local sizes.


# ----------------------------------------------------------------------------------------
# 6. draft head
#
# One Llama decoder layer whose attention reads the concatenation [embedding ; hidden]
# (2D wide). Its hidden input is either fc(target aux features) for real tokens or its own
# previous pre-norm output for drafted tokens. Pair convention: draft position p holds
# (feature of token p, token p+1) and predicts token p+2. The layer runs in three steps,
# project -> attend -> finish, so that inference (cached attention) and training-time test
# (its own attention pattern) share the two ends and differ only in the middle.
#
# Why a reduced draft vocabulary (Vd < V, d2t / t2d below): the lm_head is the drafter's
# biggest matrix (D x V: 4096 x 128k for Llama-3, larger than its decoder layer) and runs
# on every node of every level. Keeping only the Vd most frequent target tokens (32k in the
# released drafters) cuts it fourfold; the tokens it drops are rare ones the target would
# seldom accept as drafts anyway.


def log_probs(logits):
    return torch.log_softmax(logits.float(), -1)


def topk_first_index(x, k):
    """torch.topk along the last dim with ties broken toward the lower index: reproducible
    across devices, and a parent ranks ahead of an equal-scored descendant (parents have
    lower pool indices). When the k+1 best values strictly decrease no tie can reorder them
    and torch.topk is the answer; only otherwise is the (10x slower) stable sort needed."""
    values, indices = torch.topk(x, min(k + 1, x.shape[-1]))                    # (.., k+1)
    if not bool((values[..., :-1] > values[..., 1:]).all()):  # a tie (or NaN) near the top
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


class Draft(nn.Module):
    """The EAGLE-3 draft head. Parameter and buffer names are the official checkpoint keys."""

    def __init__(self, cfg, shared_embedding=None):
        super().__init__()
        self.cfg = cfg
        D, Vd = cfg.hidden_size, cfg.draft_vocab_size
        # The target's frozen embedding (shared, never saved) unless the drafter has its own.
        self.own_embedding = shared_embedding is None
        self.embed_tokens = shared_embedding or nn.Embedding(cfg.vocab_size, D)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, D, bias=False)
        self.midlayer = nn.ModuleDict(dict(
            hidden_norm=RMSNorm(D, cfg.rms_eps),
            input_layernorm=RMSNorm(D, cfg.rms_eps),
            self_attn=Attention(cfg, LOCAL, in_dim=2 * D),  # replicated on every rank
            post_attention_layernorm=RMSNorm(D, cfg.rms_eps),
            mlp=MLP(D, cfg.intermediate_size, LOCAL)))
        self.norm = RMSNorm(D, cfg.rms_eps)
        self.lm_head = nn.Linear(D, Vd, bias=False)
        if cfg.has_vocab_map:  # target id of draft id i = i + d2t[i]; t2d marks kept target ids
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def project(self, h, tokens, positions):
        """Step 1: x = [input_layernorm(embed(tokens)) ; hidden_norm(h)] (B, T, 2D) ->
        q (B, H, T, hs), k, v (B, Hkv, T, hs), RoPE applied at `positions`."""
        layer = self.midlayer
        e = self.embed_tokens(tokens).to(h.dtype)
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], dim=-1)  # (B, T, 2D)
        cos, sin = rope_cos_sin(self.cfg.inv_freq, positions, self.cfg.rope_scale, h.dtype)
        return layer.self_attn.project(x, cos, sin)

    def finish(self, h, y):
        """Step 3: attention output y (B, H, T, hs) -> the pre-norm output (B, T, D), which is
        also the next step's hidden. The residual is h, not x."""
        layer = self.midlayer
        h = h + layer.self_attn.output(y)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, h, tokens, positions, mask, cache=None, start=0):
        """h (B, T, D): fc(target features) or the previous draft output; tokens (B, T) target
        ids; mask (T, start+T). Project, attend over the cache (slots start.. written), finish."""
        q, k, v = self.project(h, tokens, positions)
        kv = None if cache is None else (cache.k[0], cache.v[0])
        k, v = cache_append(kv, start, k, v)                               # (B, Hkv, S, hs)
        return self.finish(h, attend(q, k, v, attention_bias(mask, h.dtype)))

    def logits(self, h):
        return self.lm_head(self.norm(h))  # (.., Vd)

    def continuations(self, h, scores, K):
        """The tree's ranking step: the K likeliest next tokens of each node whose drafted
        output is h (.., D), with their paths' scores: the node's `scores` (None: the root)
        plus the token's log-probability, in fp32 (fewer ties than bf16) -> (scores, ids)."""
        step, ids = topk_first_index(log_probs(self.logits(h)), K)
        return (step if scores is None else scores[..., None] + step), self.to_target_ids(ids)

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids] if self.cfg.has_vocab_map else draft_ids

    def new_cache(self, length):
        p = self.fc.weight
        return new_kv_cache(1, self.cfg.n_kv_heads, self.cfg.head_dim, length, p.dtype, p.device)


# ----------------------------------------------------------------------------------------
# 7. draft tree (the official dynamic tree of EAGLE-2/3)
#
# From the root (the token the target just chose) the drafter grows depth+1 levels. Each
# level keeps its K best nodes by cumulative log-probability and expands each into K
# children; *all* K*K children of every level enter a pool of K + depth*K^2 candidates, and
# the total_tokens-1 best of the pool (plus the root) become the tree the target verifies.
# Each round, draft_prefix catches the drafter up (section 9), grow_tree builds on top.


class TreeShape(NamedTuple):
    top_k: int = TOP_K                # K: nodes kept per level, children drafted per node
    depth: int = DEPTH                # expansion passes: drafts reach depth + 1 below the root
    total_tokens: int = TOTAL_TOKENS  # nodes the target verifies, the root included


class Tree(NamedTuple):
    tokens: torch.Tensor            # (N,) target ids; node 0 is the root
    parents: torch.Tensor           # (N,) parent node index; -1 for the root
    positions: torch.Tensor         # (N,) depth below the root (root 0)
    mask: torch.Tensor              # (N, N) bool: mask[i, j] = j is i or an ancestor of i
    retrieve_indices: torch.Tensor  # (leaves, max_depth + 1) root-to-leaf node ids, -1 padded


def tree_from_parents(tokens, parents):
    """Mask, depths and root-to-leaf paths of a tree whose parents precede their children.
    Worked example, a 5-node tree  0 -> {1, 2}, 1 -> {3}, 3 -> {4}:
        parents   = [-1, 0, 0, 1, 3]
        mask rows = 0:{0} 1:{0,1} 2:{0,2} 3:{0,1,3} 4:{0,1,3,4}   (ancestors-or-self)
        positions = row sums - 1 = [0, 1, 1, 2, 3]
        leaves    = nodes that are nobody's parent = [2, 4]
        retrieve_indices = [[0, 2, -1, -1], [0, 1, 3, 4]]   (rows by leaf index)"""
    tokens, parents = tokens.cpu(), parents.cpu()
    N = len(tokens)
    mask = torch.eye(N, dtype=torch.bool)                                        # (N, N)
    nodes, ancestor = torch.arange(N), parents.clone()
    while (ancestor >= 0).any():  # climb one level per pass: depth+1 passes reach the root
        up = ancestor >= 0
        mask[nodes[up], ancestor[up]] = True
        ancestor[up] = parents[ancestor[up]]
    positions = mask.sum(1) - 1                                                  # (N,)
    leaves = torch.isin(nodes, parents, invert=True).nonzero().flatten()       # (leaves,)
    retrieve = torch.full((len(leaves), int(positions.max()) + 1), -1, dtype=torch.long)
    row, node = mask[leaves].nonzero(as_tuple=True)  # each leaf's ancestors-or-self ...
    retrieve[row, positions[node]] = node            # ... placed by depth: root..leaf
    return Tree(tokens, parents, positions, mask, retrieve)


def select_tree(pool_scores, pool_tokens, group_parent, root, total_tokens, K):
    """Steps 4-5 of the tree: pick the best total_tokens-1 pool entries and link them.
    Pool layout (flat index s): level 1 at s = 0..K-1; iteration `it` stores child c of its
    r-th input at s = K + it*K^2 + r*K + c. Each run of K siblings is one group g = s // K,
    and group_parent[g] is the pool index of the node they hang under (-1 = the root).
    Example K=2, depth=1: pool = [a, b | a0, a1, b0, b1], group_parent = [-1, 0, 1]
    (a, b the level-1 nodes; a0 = first child of a). Choosing pool {0, 2, 3, 1} -> sorted
    [0, 1, 2, 3] = nodes 1..4 = a, b, a0, a1; parents of a0, a1: pool 0 -> node 1.
    Every chosen node's parent is chosen: a child's score is its parent's plus a log-prob
    <= 0, never above it, and a tie ranks the parent first (lower pool index)."""
    # 4) select the best; order the tree by flat index (level, parent rank, child rank)
    chosen = topk_first_index(pool_scores, total_tokens - 1)[1].sort().values   # (N-1,)
    # 5) link: each chosen node's parent pool index -> its node index (root = 0)
    parent_pool = group_parent[chosen // K]                                      # (N-1,)
    parents = torch.searchsorted(chosen, parent_pool.clamp(min=0)) + 1
    parents[parent_pool < 0] = 0
    linked = chosen[(parents - 1).clamp(min=0)] == parent_pool
    assert bool(linked[parent_pool >= 0].all()), "a selected node's parent was not selected"
    tokens = torch.cat([root.reshape(1), pool_tokens[chosen]])                   # (N,)
    return tree_from_parents(tokens, torch.cat([torch.tensor([-1]), parents.cpu()]))  # (N,)


def draft_prefix(draft, cache, start, aux, next_tokens):
    """Encode the pairs (aux[p], next_tokens[p]) at positions start.. into the drafter's
    cache -> the last output (1, D), which predicts the children of the root."""
    m = aux.shape[1]
    positions = torch.arange(start, start + m, device=aux.device)
    h = draft(draft.fc(aux), next_tokens, positions, causal_mask(m, start, aux.device),
              cache, start)                                                      # (1, m, D)
    return h[:, -1]


# The index spaces of grow_tree, worked for K = 2, depth = 2 over a drafter cache holding
# n real positions (slots 0..n-1):
#   level 1   the root's children a, b (pool 0, 1), scored from h_last; nothing is written.
#   it = 0    one draft pass over [a, b], both at RoPE position n + 0, written to cache
#             slots n + it*K + r = n, n+1. Tree-mask columns = those slots: a sees the
#             prefix and slot n (itself), b the prefix and slot n+1.
#             Their children a0 a1 b0 b1 are pool 2..5 (group_parent [0, 1]). Rerank keeps
#             the best K of the four, say a1, b0: rows [0, 1], pool inputs [3, 4].
#   it = 1    one pass over [a1, b0] at RoPE position n + 1, slots n+2, n+3. The tree mask
#             grows by K columns: rows = [the parent's row ; eye], so
#                 a1: slots n, n+1, n+2, n+3 = 1 0 1 0   (a, itself)
#                 b0:                          0 1 0 1   (b, itself)
#             Children pool 6..9 (group_parent [3, 4]).
#   pool      K + depth*K^2 = 10 candidates; select_tree takes the best total_tokens - 1.
# Positions are depths: all nodes of a level share one. The cache slots are scratch.


def grow_tree(draft, cache, n, h_last, root, shape):
    """Steps 1-3 of the official tree over a draft cache of n real positions (slots n.. are
    scratch); the drafter ranks the nodes (Draft.continuations)."""
    K, device = shape.top_k, h_last.device
    # 1) level 1: the K best children of the root
    first_scores, first_tokens = draft.continuations(h_last, None, K)           # (1, K)
    scores, tokens = first_scores[0], first_tokens[0]                          # (K,)
    pool_scores, pool_tokens = [scores], [tokens]
    group_parent = [torch.tensor([-1], device=device)]  # level 1 hangs under the root
    inputs = torch.arange(K, device=device)          # pool indices of this level's nodes
    h = h_last.expand(K, -1)                         # (K, D) the output that drafted them
    eye = torch.eye(K, dtype=torch.bool, device=device)
    tree_mask = eye                                  # (K, K) over tree slots
    for it in range(shape.depth):
        # 2) expand: one draft pass over the K nodes of level it+1, all at position n+it,
        #    each seeing the real prefix, its own ancestors and itself
        positions = torch.full((K,), n + it, device=device)
        out = draft(h[None], tokens[None], positions, prefix_mask(n, tree_mask), cache,
                    n + it * K)[0]                                           # (K, D)
        cum, children = draft.continuations(out, scores, K)  # (K, K): input r's children
        pool_scores.append(cum.flatten())                                    # (K*K,)
        pool_tokens.append(children.flatten())                               # (K*K,)
        group_parent.append(inputs)                  # input r's K children form a group
        if it == shape.depth - 1:
            break
        # 3) rerank: the K best of the K*K children become the next level's nodes
        scores, best = topk_first_index(cum.flatten(), K)                    # (K,)
        rows = best // K                             # which input each one hangs under
        inputs = K + it * K * K + best
        tokens, h = pool_tokens[-1][best], out[rows]                         # (K,), (K, D)
        tree_mask = torch.cat([tree_mask[rows], eye], 1)                     # (K, (it+2)*K)
    return select_tree(torch.cat(pool_scores), torch.cat(pool_tokens),     # (K + depth*K*K,)
                       torch.cat(group_parent), root, shape.total_tokens, K)  # (1 + depth*K,)


# ----------------------------------------------------------------------------------------
# 8. verify and accept
#
# The target scores the whole tree in one forward pass: node i sits at position n + depth(i)
# and attends to the accepted prefix plus its own ancestors. Acceptance walks down from the
# root, drawing its uniforms from one seeded stream in a documented order (section 2).
#
# Greedy speculation equals greedy decoding when each verify row produces the bits of its
# own decode step. A kernel may round a row differently when other rows share the call: in
# fp32 that rarely flips an argmax, in bf16 / fp16 it often does. How bf16 / fp16 are made
# exact is make_exact's work (section 16): every product runs with at least a few rows,
# so a row rounds alike however many share the call, and each query attends alone over the
# keys its mask shows, as its decode step does.


@torch.inference_mode()
def verify_tree(target, cache, n, tree, aux_layers):
    """Target forward of the N tree nodes, written to cache slots n..n+N-1: node i at
    position n + depth(i), seeing the prefix and its ancestors -> logits (N, V), aux
    (N, 3*D) (the features of each node's token, for the drafter's next round)."""
    device = cache[0].device
    logits, aux = target(tree.tokens[None].to(device), (n + tree.positions).to(device),
                         prefix_mask(n, tree.mask).to(device), cache, n, aux_layers)
    return logits[0], aux[0]                                          # (N, V), (N, 3*D)


def commit(cache, start, path):
    """Keep the accepted tree nodes: move the K/V of `path` (node indices, root first, in
    the N entries written after `start`) to start, start+1, ...: the official `data[...,
    n:n+a+1] = data[..., path + n]` (indexing copies first, so overlaps are safe)."""
    src = start + path
    for slab in cache:  # K and V, or MLA's latent and rope key: (L, B, heads, S, .)
        slab[:, :, :, start:start + len(path)] = slab[:, :, :, src]
    return start + len(path)


class Acceptance(NamedTuple):
    path: torch.Tensor   # (a+1,) node indices, root first
    accepted: int        # a = drafted tokens accepted
    bonus: int           # the target's own next token after the path
    uniforms: list       # the uniforms this round used, in order (empty when greedy)


def accept_greedy(logits, tree):
    """Longest root-to-leaf prefix whose every drafted token equals the target's argmax at
    its parent; the first maximal row of retrieve_indices wins; bonus = the argmax after the
    last accepted node. The argmax scans the whole vocabulary, so it is taken level by level
    only at the nodes still on a matching path (a+1 rows on a tree, not all N)."""
    R = tree.retrieve_indices                              # (leaves, depth+1)
    predicted = torch.full(tree.tokens.shape, -1)          # (N,) argmax, where needed
    alive = torch.ones(len(R), dtype=torch.bool)           # (leaves,) matching so far
    accepted = torch.zeros(len(R), dtype=torch.long)       # (leaves,) matching prefix length
    for j in range(R.shape[1] - 1):
        node, child = R[:, j], R[:, j + 1]                 # (leaves,) a live row's node >= 0
        need = node[alive].unique()
        predicted[need] = logits[need.to(logits.device)].argmax(-1).cpu()  # first maximal
        alive &= (child >= 0) & (tree.tokens[child.clamp(min=0)] == predicted[node])
        if not alive.any():
            break
        accepted += alive
    best = int(accepted.argmax())                          # first maximal row
    a = int(accepted[best])
    path = R[best, :a + 1]
    return Acceptance(path, a, int(logits[path[-1]].argmax()), [])


def top_k_mask(x, s):
    """Keep every token >= the s.top_k-th largest logit (0 = off)."""
    if s.top_k <= 0:
        return x
    kth = torch.topk(x, min(s.top_k, x.shape[-1])).values[..., -1:]
    return x.masked_fill(x < kth, -math.inf)


def top_p_mask(x, s):
    """Drop the low tokens whose cumulative probability stays <= 1 - s.top_p (1 = off); the
    top token always survives."""
    if s.top_p >= 1:
        return x
    sorted_x, order = torch.sort(x, stable=True)                        # ascending
    drop = sorted_x.softmax(-1).cumsum(-1) <= 1 - s.top_p
    drop[..., -1] = False
    return x.masked_fill(drop.scatter(-1, order, drop), -math.inf)


OFFICIAL_ORDER = (top_p_mask, top_k_mask)  # top-p before top-k: the official EAGLE code


class Sampling(NamedTuple):
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    warpers: tuple = OFFICIAL_ORDER  # applied in this order after the temperature

    @property
    def greedy(self):
        return self.temperature == 0


def warped_probs(logits, s):
    """The warped distribution in float64, with transformers' warper semantics: the
    temperature, then top-k and top-p in the order s.warpers names."""
    x = logits.double() / s.temperature
    for warp in s.warpers:
        x = warp(x, s)
    return x.softmax(-1)


def sample_inverse_cdf(p, u):
    """The token whose CDF interval [cdf(i-1), cdf(i)) contains u * sum(p): one uniform per
    token, so replaying the uniform replays the token. Zero-probability tokens never win.
    The CDF is summed in float64 on every device."""
    cdf = p.double().cumsum(-1)
    i = int(torch.searchsorted(cdf, u * cdf[-1:], right=True))
    return min(i, int(p.nonzero().max()))  # u * sum rounding up to the total: last live token


def children_of(parents):
    kids = [[] for _ in parents]
    for child, parent in enumerate(parents.tolist()[1:], start=1):
        kids[parent].append(child)  # ascending node index = descending draft rank
    return kids


def accept_sampled(logits, tree, uniforms, sampling):
    """The official recursive scheme for deterministic (top-k) drafts, i.e. q = 1.
    Order of the random draws (the replay contract):
      at the current node, for each child in ascending node index: one uniform u;
        accept the child's token x iff u < p(x), and move to it (p = its target dist.);
        otherwise set p(x) = 0, renormalise p, and try the next child;
      when no child is accepted (or the node is a leaf): one uniform for the bonus token,
        drawn from p by inverse CDF (the residual if children were rejected here).
    Lossless: each step emits x with probability p(x) and otherwise samples the rest of p."""
    coins, kids = Recorder(uniforms), children_of(tree.parents)
    node, path = 0, [0]
    p = warped_probs(logits[0], sampling)
    while True:
        for child in kids[node]:
            x = int(tree.tokens[child])
            if coins.draw() < p[x]:  # strict: a token warped to p = 0 is never accepted
                break
            p[x] = 0
            p = p / p.sum()
        else:
            break                         # every child rejected, or a leaf
        node = child
        path.append(node)
        p = warped_probs(logits[node], sampling)
    bonus = sample_inverse_cdf(p, coins.draw())
    return Acceptance(torch.tensor(path), len(path) - 1, bonus, coins.used)


def broadcast_acceptance(acceptance, max_nodes, device, tp):
    """Rank 0's acceptance on every rank, so all ranks commit the same path (ranks
    deciding independently is how TP engines have deadlocked or diverged)."""
    packed = torch.full((max_nodes + 2,), -1, dtype=torch.long, device=device)
    packed[0], packed[1] = acceptance.accepted, acceptance.bonus
    packed[2:3 + acceptance.accepted] = acceptance.path
    packed = broadcast0(packed, tp).cpu()
    a = int(packed[0])
    return Acceptance(packed[2:3 + a], a, int(packed[1]), acceptance.uniforms)


# ----------------------------------------------------------------------------------------
# 9. generation
#
# Output contract (deliberately stricter than the official loop): never more than
# max_new_tokens, nothing after the first EOS, and the bonus token is part of the output.


def emit(out, tokens, max_new_tokens, eos_token_id):
    """Append tokens to out up to the budget or the first EOS; True when generation ends."""
    for t in tokens:
        out.append(int(t))
        if len(out) == max_new_tokens or int(t) in eos_list(eos_token_id):
            return True
    return False


def next_token(logits, sampling, uniforms, tp):
    """Greedy argmax, or one uniform -> inverse CDF of the warped distribution. The token
    is rank 0's on every rank. Returns (token, uniforms used)."""
    coins = Recorder(uniforms)
    if sampling.greedy:
        token = int(logits.argmax())
    else:
        token = sample_inverse_cdf(warped_probs(logits, sampling), coins.draw())
    return int(broadcast0(torch.tensor([token], device=logits.device), tp)), coins.used


class Variant(NamedTuple):
    """The one seam for Part II's variants (a sampled chain, the engines' presets): what a
    run calls instead of the official tree and sampled acceptance, resolved before it
    starts. Without one a run is the method as written here; greedy acceptance is shared."""
    warpers: tuple   # the order its sampling warps in (the official: OFFICIAL_ORDER)
    chain: bool      # drafts a chain of depth + 1 tokens, whatever the tree
    check: object    # (sampling) -> fails on what it cannot do
    drafts: object   # (draft, cache, n, h_last, root, run, randomness, tp) -> (Tree, notes)
    sampled: object  # (logits, tree, notes, run, randomness) -> (Acceptance, Round fields)


class Run(NamedTuple):
    """What a speculative run decided when it started (checked once)."""
    shape: TreeShape
    sampling: Sampling
    record_logits: bool
    variant: Variant = None


def start_run(target, draft, prompts, max_new_tokens, temperature, top_p, top_k, tree,
              eos_token_id, record_logits, variant):
    """The Run, every argument checked (check_run) before any work. A variant's chain of
    depth+1 drafts keeps only the tree's depth."""
    sampling = Sampling(temperature, top_k, top_p, variant.warpers if variant else OFFICIAL_ORDER)
    shape = TreeShape(*tree)
    if variant and variant.chain:
        shape = TreeShape(top_k=1, depth=shape.depth, total_tokens=shape.depth + 2)
    check_run(target, draft, prompts, max_new_tokens, sampling, shape, eos_token_id, variant)
    return Run(shape, sampling, record_logits, variant)


class Round(NamedTuple):
    tree: Tree            # what the target verified (a chain is a tree with one branch)
    path: torch.Tensor    # accepted node indices, root first
    accepted: int         # drafted tokens accepted
    bonus: int            # the target's token after the path (next round's root)
    uniforms: list        # this round's uniforms in draw order (official sampling only)
    comm: Tally           # the collectives it sent (the verify, chain drafts, the decision)
    draws: dict = None    # SGLang / vLLM sampling: their random numbers, in their layout
    logits: torch.Tensor = None  # (N, V) target logits at the nodes (record_logits=True)
    draft_probs: torch.Tensor = None  # chain scheme: (k, V) q of each draft (record_logits)


class SpecResult(NamedTuple):
    tokens: torch.Tensor  # (new tokens,) the output, root of round 1 first
    accept_lengths: list  # per round: accepted + 1 (the bonus); tau = their mean
    rounds: list          # list[Round], the per-round trace
    first_uniforms: list  # the uniform that sampled the first token (sampling only)
    prefill_comm: Tally   # the collectives before round 1 (prefill and first decision)


class RoundState(NamedTuple):
    """Where a sequence's next round starts. The drafter lags the target: its position p
    pairs the target's feature of token p with token p+1 (section 6), so a token enters
    the drafter once the target has computed its feature *and* chosen the token after it.
    The prefill does both for the T prompt tokens, a verify for the a + 1 it keeps (the
    root and a accepted drafts); the next round opens by encoding those m pairs
    (draft_step). Worked example, a 4-token prompt t0..t3, round 1 accepting 2 drafts:
      prefill  the target caches t0..t3 (n = 4), features f0..f3, and chooses the root
               x4. The drafter owes positions 0..3: (f0,t1) (f1,t2) (f2,t3) (f3,x4), m = 4
      round 1  the drafter encodes 0..3 and drafts under x4 in scratch slots 4..; the
               target keeps drafts d5 d6, chooses the bonus x7 and caches x4 d5 d6 (n = 7),
               features f4 f5 f6. The drafter owes 4..6: (f4,d5) (f5,d6) (f6,x7), m = a+1 = 3
      round 2  the drafter encodes n - m .. n - 1 = 4..6 (its tree drafts there are
               overwritten) and drafts under x7."""
    n: int                     # tokens in the target's cache (the accepted prefix)
    root: int                  # the target's last token: the next tree's root
    features: torch.Tensor     # (1, m, 3*D_t) target features of the last m cached tokens
    next_tokens: torch.Tensor  # (1, m) the token after each of them: the output's new tokens


def owed(n, tokens, features, root):
    """The RoundState after the target cached `tokens` (1, m), the last m of its n, with
    their `features`, and chose `root`: the m pairs the drafter owes."""
    after = torch.cat([tokens[0, 1:], torch.tensor([root], device=tokens.device)])   # (m,)
    return RoundState(n=n, root=root, features=features, next_tokens=after[None])


def prefill(target, draft, cache, input_ids, run, randomness):
    """The prompt through the target: its first token roots round 1 and its features are
    the drafter's first m = T pairs -> (RoundState, the uniforms used, Tally sent)."""
    mark = target.tp.sent.copy()
    logits, aux = target(input_ids, cache=cache, aux_layers=draft.cfg.aux_layers)
    root, used = next_token(logits[0, -1], run.sampling, uniform_stream(randomness), target.tp)
    return owed(input_ids.shape[1], input_ids, aux, root), used, target.tp.sent.since(mark)


def draft_step(draft, cache, state, run, randomness, tp):
    """1) Encode the m pairs the drafter owes (RoundState), 2) grow the official tree on top,
    or draft as the run's variant does -> (Tree, the variant's notes for its acceptance)."""
    m = state.features.shape[1]
    h_last = draft_prefix(draft, cache, state.n - m, state.features, state.next_tokens)
    root = torch.tensor(state.root, device=h_last.device)
    if run.variant:
        return run.variant.drafts(draft, cache, state.n, h_last, root, run, randomness, tp)
    return grow_tree(draft, cache, state.n, h_last, root, run.shape), None


def decide(logits, tree, notes, run, randomness, tp):
    """4) Which drafts the target keeps, decided by rank 0 and followed by every rank ->
    (Acceptance, the variant's Round fields)."""
    if run.sampling.greedy:
        acc, fields = accept_greedy(logits, tree), {}
    elif run.variant:
        acc, fields = run.variant.sampled(logits, tree, notes, run, randomness)
    else:
        acc, fields = accept_sampled(logits, tree, uniform_stream(randomness), run.sampling), {}
    return broadcast_acceptance(acc, len(tree.tokens), logits.device, tp), fields


def settle(cache, state, tree, acc, aux):
    """5) Commit the accepted nodes' target K/V, 6) owe their features to the drafter."""
    path = acc.path.to(aux.device)
    n = commit(cache, state.n, path)
    return owed(n, tree.tokens[acc.path][None].to(aux.device), aux[path][None], acc.bonus)


def round_record(tree, acc, fields, logits, run, comm):
    return Round(tree=tree, path=acc.path, accepted=acc.accepted, bonus=acc.bonus,
                 uniforms=acc.uniforms, comm=comm,
                 logits=logits.float().cpu() if run.record_logits else None, **fields)


def speculation_round(target, draft, target_cache, draft_cache, state, run, randomness):
    """One EAGLE-3 round for one sequence: 1) encode the pairs the drafter owes, 2) draft a
    tree, 3) verify it in one target forward, 4) accept, 5) commit, 6) pass the accepted
    tokens' features on -> (Round, the next RoundState)."""
    mark = target.tp.sent.copy()
    tree, notes = draft_step(draft, draft_cache, state, run, randomness, target.tp)  # 1-2)
    logits, aux = verify_tree(target, target_cache, state.n, tree, draft.cfg.aux_layers)  # 3)
    acc, fields = decide(logits, tree, notes, run, randomness, target.tp)               # 4)
    after = settle(target_cache, state, tree, acc, aux)                                 # 5-6)
    return round_record(tree, acc, fields, logits, run, target.tp.sent.since(mark)), after


@torch.inference_mode()
def speculative_generate(target, draft, input_ids, max_new_tokens, temperature=0.0, top_p=1.0,
                         top_k=0, tree=TreeShape(), seed=0, eos_token_id=None,
                         record_logits=False, variant=None):
    """EAGLE-3 speculative decoding of one prompt (1, T): prefill, then rounds until the
    budget or an EOS. Greedy output equals plain greedy decoding token for token, sampled
    output has its distribution (section 12). `tree`: the TreeShape; top_k: the *sampling*
    top-k; `variant`: a Part II variant instead of the official method."""
    run = start_run(target, draft, [input_ids], max_new_tokens, temperature, top_p, top_k, tree,
                    eos_token_id, record_logits, variant)
    T, shape = input_ids.shape[1], run.shape
    target_cache = target.new_cache(T + max_new_tokens + shape.total_tokens)
    draft_cache = draft.new_cache(T + max_new_tokens + shape.top_k * shape.depth)
    randomness = torch.Generator().manual_seed(seed)
    state, first_uniforms, prefill_comm = prefill(target, draft, target_cache, input_ids, run,
                                                  randomness)
    out, rounds = [], []
    done = emit(out, [state.root], max_new_tokens, eos_token_id)
    while not done:
        r, state = speculation_round(target, draft, target_cache, draft_cache, state, run,
                                     randomness)
        rounds.append(r)
        done = emit(out, state.next_tokens[0].tolist(), max_new_tokens, eos_token_id)
    return SpecResult(torch.tensor(out), [r.accepted + 1 for r in rounds], rounds,
                      first_uniforms, prefill_comm)


# ----------------------------------------------------------------------------------------
# 10. training-time test (TTT)
#
# The drafter is trained on the target's own replies, with features and logits computed
# online from the frozen target. TTT unrolls the drafter 7 steps: step k feeds the drafter
# its own step k-1 outputs, as at inference depth k, so it learns to draft from its own
# (imperfect) hidden states. Data and the optimizer loop around this loss: section 19.


def shift_left(x):
    """x[:, t] <- x[:, t+1], zeros entering at the end (the official padding)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)             # (B, T, ..)


def ttt_attention(q, past):
    """Attention of TTT step k = len(past) - 1, whose (k, v) is past[-1]: the query at
    position t sees the step-0 keys at positions <= t (causal) plus, for each later step
    j = 1..k, only the key of step j at its own position t, as a depth-k tree node sees the
    real prefix plus its own ancestors. One fp32 softmax over the T + k scores."""
    B, H, T, hs = q.shape
    (k0, v0), later = past[0], past[1:]
    group = H // k0.shape[1]                                  # GQA: head h reads h // group
    k0, v0 = k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1)  # (B, H, T, hs)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(-1, -2)).masked_fill(~causal, -math.inf)]    # (B, H, T, T)
    scores += [(q * kj.repeat_interleave(group, 1)).sum(-1, keepdim=True)   # (B, H, T, 1)
               for kj, _ in later]
    scores = torch.cat(scores, -1)                                           # (B, H, T, T+k)
    w = torch.softmax(scores.float() / math.sqrt(hs), -1).to(q.dtype)
    y = w[..., :T] @ v0                                                       # (B, H, T, hs)
    for j, (_, vj) in enumerate(later):
        y = y + w[..., T + j:T + j + 1] * vj.repeat_interleave(group, 1)
    return y


class TTTResult(NamedTuple):
    loss: torch.Tensor   # sum_k 0.8**k * loss_k
    losses: list         # per step
    hits: list           # per step: correct top-1 drafts at loss-masked positions
    counts: list         # per step: loss-masked positions
    correct: list        # per step: (B, T) bool, where those hits are
    scored: list         # per step: (B, T) bool, where the loss-masked positions are


def ttt_teacher(draft, target_logits):
    """The TTT teacher for step 0: teacher[t] = the target's distribution of x[t+2],
    restricted to the draft vocab (B, T, Vd), and whether its full-vocab argmax lies
    inside the draft vocab (B, T): positions where it does not get no loss."""
    if not draft.cfg.has_vocab_map:
        teacher = shift_left(target_logits.float())                      # (B, T, V)
        return torch.softmax(teacher, -1), torch.ones_like(teacher[..., 0])
    # select, then shift (the same numbers: zero logits enter, argmax 0): the (B, T, V)
    # logits are read twice and never copied
    teacher = shift_left(target_logits[..., draft.t2d].float())             # (B, T, Vd)
    in_vocab = draft.t2d[shift_left(target_logits.argmax(-1))].float()      # (B, T)
    return torch.softmax(teacher, -1), in_vocab


def ttt_loss(draft, aux, input_ids, loss_mask, target_logits, steps=TTT_STEPS,
             decay=TTT_DECAY, denominator=None):
    """The EAGLE-3 training-time-test loss on a batch. aux (B, T, 3*D_t) and target_logits
    (B, T, V) come from the frozen target on input_ids (B, T). At step k position t holds
    token x[t+1+k] and predicts x[t+2+k]; loss_mask[t] = 1 where x[t+2] is a reply token
    (collate, section 19), and shifts along. loss_k is summed over the vocab and divided
    by all B*T positions (masked ones included, as the official code and SpecForge do);
    `denominator` overrides B*T for data-parallel shards of a global batch."""
    B, T = input_ids.shape
    p, in_vocab = ttt_teacher(draft, target_logits)
    p_top, ids, mask = p.argmax(-1), shift_left(input_ids), loss_mask.float()
    positions = torch.arange(T, device=input_ids.device)
    h, past = draft.fc(aux.to(draft.fc.weight.dtype)), []                # (B, T, D)
    losses, correct, scored = [], [], []
    for step in range(steps):  # the teacher, its argmax and the masks shift once per step
        q, k, v = draft.project(h, ids, positions + step)
        past.append((k, v))
        h = draft.finish(h, ttt_attention(q, past))
        log_q = log_probs(draft.logits(h))                               # (B, T, Vd)
        losses.append(-(in_vocab * mask * (p * log_q).sum(-1)).sum() / (denominator or B * T))
        correct.append((log_q.argmax(-1) == p_top) & (in_vocab * mask > 0))
        scored.append(mask > 0)
        ids, p, p_top, in_vocab, mask = map(shift_left, (ids, p, p_top, in_vocab, mask))
    loss = sum(decay ** k * loss_k for k, loss_k in enumerate(losses))
    return TTTResult(loss, losses, [c.float().sum() for c in correct],
                     [s.float().sum() for s in scored], correct, scored)


# ========================================================================================
#
#   PART II: VARIANTS AND TOOLS
#
#   First the variants of the method a learner can skip: the engines' conventions,
#   batched decoding, DeepSeek-V3 / Kimi targets. Then what running it needs: checkpoint and
#   config IO, training, tiny models, golden traces, the demo and the command line.
#   Everything below uses Part I; nothing above calls anything below.
#
# ========================================================================================

RUNS_DIR = "runs"           # every generated file lives under here (git-ignored)
TINY_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_configs")


def read_json(path):
    """A JSON object from a file, or a one-line error naming the file and where it breaks."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        fail(f"{path!r} does not exist")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if hasattr(e, "lineno") else ""
        fail(f"{path!r} is not valid JSON ({getattr(e, 'msg', e)}{where}); fix the file or "
             f"restore it from the model's source")
    if not isinstance(obj, dict):
        fail(f"{path!r} holds a JSON {type(obj).__name__}; expected an object {{...}}")
    return obj


def why(e):
    """A library's exception as 'Type: its first sentence', for a one-line error."""
    text = (str(e).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(e).__name__}: {text[:160]}"


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def atomic_write(path, write):
    """Write to NAME.tmp, then rename: an interrupted run never leaves a half-written NAME.
    The file gets the umask's mode (safetensors writes 0600, hiding it from other users)."""
    tmp = f"{path}.tmp"
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------------------
# 11. launch: torchrun's process group, and output from rank 0 only


def init_distributed():
    """Join torchrun's process group (nccl on GPUs, else gloo) -> this process's rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds to this device
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank


def world_info():
    """(rank, world) of the current TP group; (0, 1) when no process group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank0():
    return world_info()[0] == 0


def print0(*args, **kwargs):
    if is_rank0():
        print(*args, **kwargs, flush=True)


# ----------------------------------------------------------------------------------------
# 12. baselines: plain decoding, and one tree drafted from scratch
#
# What speculative decoding is held to: plain decoding with a KV cache, one target forward
# per token (greedy speculation equals greedy_generate token for token, sampled speculation
# has the distribution of sample_generate). draft_tree drafts one tree from scratch, as the
# official code's topK_genrate.


@torch.inference_mode()
def autoregressive_generate(target, input_ids, max_new_tokens, sampling, seed, eos_token_id,
                            record_logits=False):
    """Plain decoding with a KV cache: one target forward per token. -> the new tokens, and
    with record_logits (new tokens, V) fp32: the logits each token was chosen from."""
    check_sampling(sampling)
    check_generation_args(input_ids, max_new_tokens, target.cfg.max_positions,
                          target.cfg.vocab_size)
    check_eos(eos_token_id, target.cfg.vocab_size)
    uniforms = uniform_stream(torch.Generator().manual_seed(seed))
    n = input_ids.shape[1]
    cache = target.new_cache(n + max_new_tokens)
    logits, _ = target(input_ids, cache=cache, aux_layers=())
    out, seen = [], []
    while True:
        token, _ = next_token(logits[0, -1], sampling, uniforms, target.tp)
        if record_logits:
            seen.append(logits[0, -1].float().cpu())
        if emit(out, [token], max_new_tokens, eos_token_id):
            return (torch.tensor(out), torch.stack(seen)) if record_logits else torch.tensor(out)
        logits, _ = target(torch.tensor([[token]], device=input_ids.device), cache=cache,
                           start=n, aux_layers=())
        n += 1


def greedy_generate(target, input_ids, max_new_tokens, eos_token_id=None, record_logits=False):
    """Argmax decoding: the baseline greedy speculation must equal. record_logits=True also
    returns each decode step's logits (new tokens, V), to hold a verify row against."""
    return autoregressive_generate(target, input_ids, max_new_tokens, Sampling(), 0,
                                   eos_token_id, record_logits)


def sample_generate(target, input_ids, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                    seed=0, eos_token_id=None, variant=None):
    """Plain sampling: one uniform per token, inverse CDF of the warped distribution (warped
    in the official order, or a variant's: the distribution its speculative decoding keeps)."""
    sampling = Sampling(temperature, top_k, top_p, variant.warpers if variant else OFFICIAL_ORDER)
    return autoregressive_generate(target, input_ids, max_new_tokens, sampling, seed,
                                   eos_token_id)


@torch.inference_mode()
def draft_tree(draft, aux, input_ids, top_k=TOP_K, depth=DEPTH, total_tokens=TOTAL_TOKENS):
    """One round of drafting from scratch, as the official `topK_genrate`: aux (1, T, 3*D_t)
    are the target features of tokens 0..T-1, input_ids (1, T+1) those tokens plus the root."""
    shape = TreeShape(top_k=top_k, depth=depth, total_tokens=total_tokens)
    check_tree_shape(shape, draft.cfg.draft_vocab_size)
    T = aux.shape[1]
    if input_ids.shape != (1, T + 1):
        fail(f"input_ids has shape {tuple(input_ids.shape)}; with aux of {T} positions it must "
             f"be (1, {T + 1}): the {T} featured tokens plus the root")
    check_token_ids(input_ids, draft.cfg.vocab_size)
    cache = draft.new_cache(T + top_k * depth)
    h_last = draft_prefix(draft, cache, 0, aux, input_ids[:, 1:])
    return grow_tree(draft, cache, T, h_last, input_ids[0, -1], shape)


# ----------------------------------------------------------------------------------------
# 13. variants of verification: a sampled chain; the engines' conventions (SGLang, vLLM)
#                                                                (a learner can skip this)
# The official tree drafts deterministically (top-k), so its acceptance uses q = 1. The
# classic alternative samples a chain of drafts from the drafter's own warped q and accepts
# with min(1, p/q): speculative_generate(..., variant=resolve_variant(scheme="chain")).


def draft_chain(draft, cache, n, h_last, root, length, uniforms, sampling, tp):
    """Sample a chain of drafts from the drafter's own warped q, one uniform per draft
    (inverse CDF) -> the chain as a Tree, q over the target vocab (k, V), the uniforms."""
    device, V = h_last.device, draft.cfg.vocab_size
    coins, tokens, q_rows = Recorder(uniforms), [], []
    in_target = draft.to_target_ids(torch.arange(draft.cfg.draft_vocab_size, device=device))
    h = h_last[None]                                                # (1, 1, D)
    for i in range(length):
        q_draft = warped_probs(draft.logits(h[0, -1]), sampling)    # (Vd,)
        sampled = broadcast0(torch.tensor([sample_inverse_cdf(q_draft, coins.draw())],
                                          device=device), tp)
        token = draft.to_target_ids(sampled)  # rank 0's draft on every rank
        q = torch.zeros(V, dtype=torch.float64, device=device)
        q[in_target] = q_draft                                      # (V,)
        tokens.append(token)
        q_rows.append(q)
        if i < length - 1:  # pair (output that drafted it, token) at position n+i
            positions = torch.tensor([n + i], device=device)
            h = draft(h[:, -1:], token[None], positions, causal_mask(1, n + i, device),
                      cache, n + i)                                 # (1, 1, D)
    chain = torch.cat([root.reshape(1)] + tokens)                   # (length+1,)
    tree = tree_from_parents(chain, torch.arange(-1, length))
    return tree, torch.stack(q_rows), coins.used                    # q: (length, V)


def accept_chain(logits, drafts, q, uniforms, sampling):
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of k drafts
    sampled from q (k, V). After the drafting uniforms: per draft one uniform u, accept iff
    u * q_i(x) < p_i(x); at the first rejection one uniform for the token from
    norm(max(0, p_i - q_i)); if all pass, one uniform for the bonus from p_k."""
    coins, k = Recorder(uniforms), len(drafts)
    for i, x in enumerate(drafts.tolist()):
        p = warped_probs(logits[i], sampling)
        if coins.draw() * q[i, x] < p[x]:
            continue
        residual = (p - q[i]).clamp(min=0)
        bonus = sample_inverse_cdf(residual if residual.sum() > 0 else p, coins.draw())
        return Acceptance(torch.arange(i + 1), i, bonus, coins.used)
    bonus = sample_inverse_cdf(warped_probs(logits[k], sampling), coins.draw())
    return Acceptance(torch.arange(k + 1), k, bonus, coins.used)


def chain_draft(draft, cache, n, h_last, root, run, randomness, tp):
    """draft_chain as the Variant's drafts: the chain, and (q, the drafting uniforms)."""
    tree, q, used = draft_chain(draft, cache, n, h_last, root, run.shape.depth + 1,
                                uniform_stream(randomness), run.sampling, tp)
    return tree, (q, used)


def chain_accept(logits, tree, notes, run, randomness):
    """accept_chain as the Variant's sampled acceptance: its uniforms follow the drafting
    ones, and with record_logits the drafts' q (k, V) is the Round's draft_probs."""
    q, drafting = notes
    acc = accept_chain(logits, tree.tokens[1:], q, uniform_stream(randomness), run.sampling)
    fields = dict(draft_probs=q.cpu()) if run.record_logits else {}
    return Acceptance(path=acc.path, accepted=acc.accepted, bonus=acc.bonus,
                      uniforms=[*drafting, *acc.uniforms]), fields


def check_chain(sampling):
    if sampling.greedy:
        fail("scheme='chain' samples its drafts and needs temperature > 0; at temperature 0 "
             "use scheme='tree' (a greedy chain is a tree with top_k=1)")


# SGLang and vLLM score trees, verify samples and draw their random numbers differently
# from the official code. Both are lossless at their defaults; the same coins give
# different tokens. Each is a Preset, resolved by resolve_variant() below.

TRANSFORMERS_ORDER = (top_k_mask, top_p_mask)  # temperature, top-k, top-p: transformers,
                                               # SGLang, vLLM


class EngineDrafter(NamedTuple):
    """The drafter as an engine's tree drives it (grow_tree reads its draft pass and its
    ranking step alone): with `probabilities` a path scores the product of its tokens' fp32
    probabilities (SGLang, vLLM; the same order up to rounding), with `pos_offset` 1 every
    level is drafted one RoPE position late (SGLang before sgl-project/sglang#25015)."""
    draft: Draft
    probabilities: bool
    pos_offset: int

    def __call__(self, h, tokens, positions, mask, cache, start):
        return self.draft(h, tokens, positions + self.pos_offset, mask, cache, start)

    def continuations(self, h, scores, K):
        if not self.probabilities:
            return self.draft.continuations(h, scores, K)
        step, ids = topk_first_index(torch.softmax(self.draft.logits(h).float(), -1), K)
        scores = step if scores is None else scores[..., None] * step
        return scores, self.draft.to_target_ids(ids)


def cdf_pick(r, coin):
    """SGLang's final draw: the first id with r > 0 whose cumulative sum exceeds coin *
    sum(r) (else the last id with r > 0, else V - 1). The sum runs in float64, each prefix
    rounded to fp32, as torch's CPU fp32 cumsum does but CUDA's does not: a coin within an
    ulp of a boundary would pick another token on CPU and GPU (and can in SGLang's kernel)."""
    cdf = r.double().cumsum(-1).float()
    hit = ((cdf > coin * cdf[-1]) & (r > 0)).nonzero()
    live = (r > 0).nonzero()
    return int(hit[0]) if len(hit) else int(live[-1]) if len(live) else len(r) - 1


def accept_cumulative(p, tree, coins, final_coin, threshold_single=1.0, threshold_acc=1.0,
                      kids=None):
    """SGLang's tree_speculative_sampling_target_only, in fp32. p (N, V): the warped
    target distribution at every node; coins (N,): one per node, read at the nodes that
    become parents. At a node, its children (`kids`, default ascending node index, as
    SGLang builds trees) add their unnormalised p to a running sum; a child is accepted when
    coin <= sum / threshold_acc or p >= threshold_single: one coin is an inverse-CDF draw
    over the children (lossless at thresholds 1, 1). The bonus: final_coin through the CDF
    of r = p at the last accepted node minus the rejected children's p."""
    kids, ta = kids or children_of(tree.parents), max(threshold_acc, 1e-9)
    node, path, depth = 0, [0], tree.retrieve_indices.shape[1] - 1
    rejected = torch.zeros_like(p[0])
    while len(path) <= depth:
        mass, coin = torch.zeros((), dtype=torch.float32), coins[node]
        for child in kids[node]:
            x = int(tree.tokens[child])
            mass = mass + p[node, x]                     # fp32 running sum, as the kernel
            if coin <= mass / ta or p[node, x] >= threshold_single:
                break
            rejected[x] = p[node, x]
        else:
            break                                        # every child rejected, or a leaf
        node, rejected = child, torch.zeros_like(rejected)
        path.append(node)
    r = p[node] if len(path) > depth else (p[node] - rejected).clamp(min=0)
    return Acceptance(torch.tensor(path), len(path) - 1, cdf_pick(r, final_coin), [])


def sglang_verify(logits, tree, g, sampling, preset):
    """SGLang's random numbers, in its order: one float32 coin per tree node, then one final
    coin (and the generator state before them, which replays both)."""
    state = g.get_state()
    draws = dict(coins=torch.rand(len(tree.tokens), generator=g),
                 final_coin=torch.rand(1, generator=g), generator_state=state)
    p = warped_probs(logits.cpu(), sampling).float()                           # (N, V) fp32
    return accept_cumulative(p, tree, draws["coins"], draws["final_coin"][0],
                             preset.threshold_single, preset.threshold_acc), draws


def accept_onehot(p, drafts, uniforms, exponentials, bonus):
    """vLLM's rejection sampler for argmax drafts (q one-hot), in fp32: draft i is accepted
    iff p[i](x) >= uniforms[i] (float64); at the first rejection the token is argmax(r / E),
    r = p[i] with x zeroed, E an Exp(1) vector (an exponential race: a sample of r / sum r);
    after the last draft, the bonus (drawn before verification by the plain sampler)."""
    for i, x in enumerate(drafts.tolist()):
        if float(p[i, x]) >= float(uniforms[i]):
            continue
        r = p[i].clone()
        r[x] = 0
        return Acceptance(torch.arange(i + 1), i, int((r * (1 / exponentials)).argmax()), [])
    return Acceptance(torch.arange(len(drafts) + 1), len(drafts), bonus, [])


def vllm_verify(logits, tree, g, sampling, preset):
    """vLLM's random numbers, in its order: the plain sampler's Exp(1) vector for the bonus,
    one float64 uniform per draft, then one Exp(1) vector for the recovered token."""
    V, state = logits.shape[-1], g.get_state()
    draws = dict(bonus_exponentials=torch.empty(V).exponential_(generator=g),
                 draft_uniforms=torch.rand(len(tree.tokens) - 1, dtype=torch.float64, generator=g),
                 exponentials=torch.empty(V).exponential_(generator=g), generator_state=state)
    p = warped_probs(logits.cpu(), sampling).float()                           # (N, V) fp32
    bonus = int((p[-1] * (1 / draws["bonus_exponentials"])).argmax())
    return accept_onehot(p, tree.tokens[1:], draws["draft_uniforms"], draws["exponentials"],
                         bonus), draws


def official_verify(logits, tree, randomness, sampling, preset):
    """The official acceptance (Part I's accept_sampled) as a preset's verification rule."""
    return accept_sampled(logits, tree, uniform_stream(randomness), sampling), None


class Preset(NamedTuple):
    """An engine's EAGLE-3 conventions as the functions and numbers they choose; resolve_variant()
    resolves one into the Variant a run hands the round. In all three PRESETS the output
    stops exactly at max_new_tokens and at the first EOS, and siblings are tried in
    ascending node index."""
    name: str                 # for reports and golden headers; never branched on
    probabilities: bool       # tree scores: fp32 probabilities that multiply (SGLang, vLLM),
                              # else fp32 log-probabilities that add (official)
    argmax_chain: bool        # draft a chain of argmax drafts whatever the tree (vLLM)
    warpers: tuple            # warper order: OFFICIAL_ORDER or TRANSFORMERS_ORDER
    verify: object            # sampled verification of a tree: (logits, tree, randomness,
                              # sampling, preset) -> (Acceptance, the engine's draws or None)
    draft_pos_offset: int = 0      # 1: levels drafted one RoPE position late (SGLang < #25015)
    threshold_single: float = 1.0  # SGLang: a child with p >= this is accepted (1.0 = off)
    threshold_acc: float = 1.0     # SGLang: accept when coin <= sum(p) / this (1.0: lossless)
    tau_emitted: bool = False  # reported accept length: tokens actually emitted per round
                               # (SGLang); else mean(accepted + 1) as decided, drafts after an
                               # EOS included (official, vLLM)


PRESETS = dict(
    official=Preset("official", probabilities=False, argmax_chain=False, warpers=OFFICIAL_ORDER,
                    verify=official_verify),
    sglang=Preset("sglang", probabilities=True, argmax_chain=False, warpers=TRANSFORMERS_ORDER,
                  verify=sglang_verify, tau_emitted=True),
    vllm=Preset("vllm", probabilities=True, argmax_chain=True, warpers=TRANSFORMERS_ORDER,
                verify=vllm_verify))
SCHEMES = ("tree", "chain")


def as_preset(preset):
    """A preset name (resolved here, once per run) or a Preset."""
    if isinstance(preset, Preset):
        return preset
    if preset not in PRESETS:
        fail(f"preset={preset!r} must be one of {', '.join(PRESETS)} (or a Preset)")
    return PRESETS[preset]


def resolve_variant(preset="official", scheme="tree"):
    """The Variant a run hands Part I's round, resolved from the public names: `preset`
    "official", "sglang", "vllm" (or a Preset), `scheme` "tree" (the preset's tree) or
    "chain" (drafts sampled from the drafter's q; official preset only). The official
    preset's tree is the method itself: None."""
    preset = as_preset(preset)
    if scheme not in SCHEMES:
        fail(f"scheme={scheme!r} must be one of {SCHEMES}")
    if scheme == "chain":
        if preset.verify is not official_verify:
            fail(f"scheme='chain' is the official code's variant; preset {preset.name!r} "
                 f"verifies its own drafts: use scheme='tree'")
        return Variant(preset.warpers, True, check_chain, chain_draft, chain_accept)
    if preset == PRESETS["official"]:
        return None

    def tree_draft(draft, cache, n, h_last, root, run, randomness, tp):
        engine = EngineDrafter(draft, preset.probabilities, preset.draft_pos_offset)
        return grow_tree(engine, cache, n, h_last, root, run.shape), None

    def tree_accept(logits, tree, notes, run, randomness):
        acc, draws = preset.verify(logits, tree, randomness, run.sampling, preset)
        return acc, dict(draws=draws)
    return Variant(preset.warpers, preset.argmax_chain, lambda sampling: None,
                   tree_draft, tree_accept)


# ----------------------------------------------------------------------------------------
# 14. variant: a batch of prompts, verified in one forward            (a learner can skip this)
#
# As the engines batch: each sequence drafts its own tree with its own state and random
# numbers; one target forward verifies all B trees (per-row positions and masks), writing
# every row's nodes after the longest prefix; they then move to the row's own slots, so each
# row settles as a batch-1 sequence does, and stops on its own.


def row_cache(cache, b):
    """Row b of a batched cache as a batch-1 cache of views (writes land in the batch)."""
    return type(cache)(*(slab[:, b:b + 1] for slab in cache))


@torch.inference_mode()
def verify_trees(target, cache, ns, trees, aux_layers):
    """verify_tree for B sequences in one forward -> per row (logits (N_b, V), aux
    (N_b, 3*D)). Trees are padded to the widest with nodes that see only the prefix and
    themselves; all are written after the longest prefix, then moved to their own slots."""
    B, N, s, device = len(trees), max(len(t.tokens) for t in trees), max(ns), cache[0].device
    tokens = torch.zeros(B, N, dtype=torch.long)                                # (B, N)
    positions = torch.tensor(ns)[:, None].repeat(1, N)                          # (B, N)
    mask = torch.zeros(B, N, s + N, dtype=torch.bool)                           # (B, N, S)
    for b, (n, t) in enumerate(zip(ns, trees)):
        k = len(t.tokens)
        tokens[b, :k], positions[b, :k] = t.tokens, n + t.positions
        local = torch.eye(N, dtype=torch.bool)           # padding nodes see themselves
        local[:k, :k] = t.mask
        mask[b, :, :n], mask[b, :, s:] = True, local
    logits, aux = target(tokens.to(device), positions.to(device), mask.to(device), cache, s,
                         aux_layers)
    for slab in cache:  # (L, B, heads, S, .): row b's nodes to its own slots n_b..
        for b, n in enumerate(ns):
            slab[:, b, :, n:n + N] = slab[:, b, :, s:s + N].clone()
    return [(logits[b, :len(t.tokens)], aux[b, :len(t.tokens)]) for b, t in enumerate(trees)]


@torch.inference_mode()
def speculative_generate_batch(target, draft, prompts, max_new_tokens, temperature=0.0,
                               top_p=1.0, top_k=0, tree=TreeShape(), seed=0, eos_token_id=None,
                               record_logits=False, variant=None):
    """speculative_generate of B prompts (1, T_b) verified together -> a SpecResult each.
    Row b's generator is seeded seed + b; its rounds' `comm` is the whole batched round's."""
    run = start_run(target, draft, prompts, max_new_tokens, temperature, top_p, top_k, tree,
                    eos_token_id, record_logits, variant)
    B, longest, shape = len(prompts), max(ids.shape[1] for ids in prompts), run.shape
    # A finished row rides along in the verify (its root alone, padded to the widest tree)
    # after a last round that may have committed up to depth+1 tokens past its budget.
    cache = target.new_cache(longest + max_new_tokens + shape.depth + 1 + shape.total_tokens,
                             batch=B)
    draft_caches = [draft.new_cache(ids.shape[1] + max_new_tokens + shape.top_k * shape.depth)
                    for ids in prompts]
    randomness = [torch.Generator().manual_seed(seed + b) for b in range(B)]
    states, first, prefill_comm = zip(*(prefill(target, draft, row_cache(cache, b), ids, run,
                                                randomness[b]) for b, ids in enumerate(prompts)))
    states, out, rounds = list(states), [[] for _ in prompts], [[] for _ in prompts]
    active = [b for b in range(B) if not emit(out[b], [states[b].root], max_new_tokens,
                                              eos_token_id)]
    while active:
        mark = target.tp.sent.copy()
        drafted = {b: draft_step(draft, draft_caches[b], states[b], run, randomness[b], target.tp)
                   for b in active}
        trees = [drafted[b][0] if b in drafted else tree_from_parents(
            torch.tensor([s.root]), torch.tensor([-1])) for b, s in enumerate(states)]
        verified = verify_trees(target, cache, [s.n for s in states], trees, draft.cfg.aux_layers)
        decided = {}
        for b in active:
            (tree, notes), (logits, aux) = drafted[b], verified[b]
            acc, fields = decide(logits, tree, notes, run, randomness[b], target.tp)
            states[b] = settle(row_cache(cache, b), states[b], tree, acc, aux)
            decided[b] = tree, acc, fields, logits
        comm = target.tp.sent.since(mark)   # the whole batched round's, in each row's Round
        for b, (tree, acc, fields, logits) in decided.items():
            rounds[b].append(round_record(tree, acc, fields, logits, run, comm))
        active = [b for b in active
                  if not emit(out[b], states[b].next_tokens[0].tolist(), max_new_tokens,
                              eos_token_id)]
    return [SpecResult(torch.tensor(out[b]), [r.accepted + 1 for r in rounds[b]], rounds[b],
                       first[b], prefill_comm[b]) for b in range(B)]


# ----------------------------------------------------------------------------------------
# 15. variant: DeepSeek-V3 / Kimi targets (MLA + MoE)                 (a learner can skip this)
#
# model_type deepseek_v3, kimi_k2, kimi_k25: multi-head latent attention (MLA) and a
# sigmoid-routed mixture of experts (MoE), exactly as transformers' DeepseekV3ForCausalLM.
# They plug into the Block where the dense model chooses its attention and MLP; all else is
# unchanged. TP: q_b/q_proj and kv_b column-parallel by head, o_proj row-parallel, experts
# sharded along their width, routed + shared summed before one all_reduce: 2 all-reduces
# per layer (SGLang's layout; the official DeepSeek code has 3).


@dataclass
class MLAConfig:
    """DeepSeek-V3 multi-head latent attention (head_dim of TargetConfig = qk_rope_head_dim)."""
    q_lora_rank: int           # q = q_b(norm(q_a(x))); None: one plain q_proj
    kv_lora_rank: int          # r: the normalised latent the KV cache holds per token
    qk_nope_head_dim: int      # dn: per-head key/query part without position
    qk_rope_head_dim: int      # dr: the rotated part; one k_pe head shared by all heads
    v_head_dim: int            # dv: may differ from dn
    softmax_scale: float       # (dn + dr)^-0.5 times the YaRN mscale^2, as transformers
    latent_eps: float          # eps of q_a/kv_a_layernorm: 1e-6 in transformers, always
    rope_interleave: bool      # rope pairs stored at (2i, 2i+1) (DeepSeek's weights), as
                               # transformers' rope_interleave; False: halves (i, i + dr/2)


@dataclass
class MoEConfig:
    """DeepSeek-V3 sigmoid-routed mixture of experts ("noaux_tc" routing)."""
    n_routed: int              # E routed experts
    n_shared: int              # shared experts: one SwiGLU of width n_shared*width, every token
    top_k: int                 # experts per token
    n_group: int               # expert groups (Kimi: 1, no group limit)
    topk_group: int            # groups a token may route into
    width: int                 # moe_intermediate_size, each expert's SwiGLU width
    norm_topk_prob: bool       # renormalise the k weights to sum 1
    scaling: float             # routed_scaling_factor, applied after the renormalisation
    first_dense: int           # first_k_dense_replace: layers below it keep a dense MLP


class LatentCache(NamedTuple):
    """The MLA cache, as production engines keep it: per token and layer the normalised
    latent and the rotated shared rope key (r + dr values), not per-head K/V (2*H*hs)."""
    latent: torch.Tensor  # (L, B, 1, S, r)
    k_pe: torch.Tensor    # (L, B, 1, S, dr)


class MLAttention(nn.Module):
    def __init__(self, cfg, tp):
        super().__init__()
        m, D = cfg.mla, cfg.hidden_size
        self.m, self.tp, self.H = m, tp, cfg.n_heads // tp.size
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:       # replicated down-projection and norm, column-parallel up
            self.q_a_proj = nn.Linear(D, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.latent_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(D, self.H * qk, bias=False)
        # replicated: the latent and the shared rope key are the same on every rank
        self.kv_a_proj_with_mqa = nn.Linear(D, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.latent_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.H * (m.qk_nope_head_dim + m.v_head_dim),
                                   bias=False)                             # column-parallel
        self.o_proj = nn.Linear(self.H * m.v_head_dim, D, bias=False)      # row-parallel
        self.attend = attend  # the attention core, as the dense Attention's (make_exact swaps it)

    def rope(self, x, cos, sin):
        # DeepSeek's weights pair rope dims (2i, 2i+1): evens then odds makes rotate-half
        # rotate those pairs (q.k is unchanged by the permutation)
        if self.m.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)                          # (.., dr)
        return apply_rope(x, cos, sin)

    def forward(self, x, cos, sin, bias, kv=None, start=0):
        B, T, _ = x.shape
        m, H = self.m, self.H
        dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(B, T, H, dn + dr).transpose(1, 2)                     # (B, H, T, dn+dr)
        q_nope, q_pe = q.split([dn, dr], -1)                             # (B, H, T, dn / dr)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, dr], -1)  # (B, T, r / dr)
        latent = self.kv_a_layernorm(latent)[:, None]                    # (B, 1, T, r)
        q_pe = self.rope(q_pe, cos, sin)                                 # (B, H, T, dr)
        k_pe = self.rope(k_pe[:, None], cos, sin)                        # (B, 1, T, dr)
        latent, k_pe = cache_append(kv, start, latent, k_pe)             # (B, 1, S, r / dr)
        S = latent.shape[2]
        # Expand the latent into per-head keys and values. The engines' "absorbed" form
        # folds kv_b_proj into q and o instead; the result is equal up to round-off.
        kv_heads = self.kv_b_proj(latent[:, 0]).view(B, S, H, dn + dv)      # (B, S, H, dn+dv)
        k_nope, v = kv_heads.transpose(1, 2).split([dn, dv], -1)          # (B, H, S, dn / dv)
        k = torch.cat([k_nope, k_pe.expand(-1, H, -1, -1)], -1)          # (B, H, S, dn+dr)
        q = torch.cat([q_nope, q_pe], -1)                                # (B, H, T, dn+dr)
        y = self.attend(q, k, v, bias, m.softmax_scale)                  # (B, H, T, dv)
        y = y.transpose(1, 2).reshape(B, T, H * dv)                      # (B, T, H*dv)
        return all_reduce(self.o_proj(y), self.tp)  # row-parallel: sum the partials


class Router(nn.Module):
    """DeepSeek-V3 routing in fp32 (near-tied experts flip in bf16): sigmoid scores; the
    correction bias only *selects*, among the experts of the topk_group best groups (a group
    scores its top-2 biased scores); weights: the chosen k's sigmoids, renormalised, scaled."""

    def __init__(self, cfg):
        super().__init__()
        self.moe = cfg.moe
        self.weight = nn.Parameter(torch.zeros(cfg.moe.n_routed, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.moe.n_routed))
        self.product = F.linear  # make_exact swaps in a row-invariant one (still fp32)

    def forward(self, x):
        """x (N, D) -> weights (N, k) fp32 and expert ids (N, k)."""
        moe, N = self.moe, x.shape[0]
        scores = self.product(x.float(), self.weight.float()).sigmoid()              # (N, E)
        biased = scores + self.e_score_correction_bias.float()
        groups = biased.view(N, moe.n_group, -1)                                     # (N, G, E/G)
        best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(moe.topk_group, -1).indices
        allowed = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(1, best_groups, True)
        allowed = allowed[:, :, None].expand_as(groups).reshape(N, -1)               # (N, E)
        experts = biased.masked_fill(~allowed, -math.inf).topk(moe.top_k, -1).indices
        weights = scores.gather(1, experts)                                          # (N, k)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.scaling, experts


class MoE(nn.Module):
    def __init__(self, cfg, tp):
        super().__init__()
        moe, D = cfg.moe, cfg.hidden_size
        self.tp = tp
        self.gate = Router(cfg)  # replicated: every rank routes identically (see forward)
        self.experts = nn.ModuleList(MLP(D, moe.width, tp) for _ in range(moe.n_routed))
        self.shared_experts = MLP(D, moe.width * moe.n_shared, tp)

    def forward(self, x):
        # Every rank computes the same routing because x is the all-reduced residual stream,
        # bitwise identical on all ranks; each rank then runs its slice of every chosen
        # expert and of the shared experts, and one all_reduce sums them all.
        B, T, D = x.shape
        flat = x.reshape(B * T, D)                                                   # (BT, D)
        weights, experts = self.gate(flat)                                           # (BT, k)
        y = torch.zeros_like(flat)
        for e in experts.unique().tolist():                 # ascending, as transformers
            token, slot = (experts == e).nonzero(as_tuple=True)
            out = self.experts[e].partial(flat[token]) * weights[token, slot, None]
            y.index_add_(0, token, out.to(y.dtype))
        y = y + self.shared_experts.partial(flat)
        return all_reduce(y.view(B, T, D), self.tp)                                 # (B, T, D)


class DeepSeekTarget(Target):
    """MLA in every layer, MoE from layer first_dense on, and the (replicated) latent cache."""

    def attention(self, layer):
        return MLAttention(self.cfg, self.tp)

    def mlp(self, layer):
        if not self.cfg.moe or layer < self.cfg.moe.first_dense:
            return super().mlp(layer)
        return MoE(self.cfg, self.tp)

    def new_cache(self, length, batch=1):
        cfg, p = self.cfg, self.lm_head.weight
        shape = (cfg.n_layers, batch, 1, length)
        return LatentCache(p.new_zeros(shape + (cfg.mla.kv_lora_rank,)),
                           p.new_zeros(shape + (cfg.mla.qk_rope_head_dim,)))


# ----------------------------------------------------------------------------------------
# 16. variant: exact in low precision                                 (a learner can skip this)
#
# Greedy speculation equals greedy decoding when every verify row rounds as its decode step
# (section 8). In bf16 / fp16 the plain path breaks this in two places; make_exact mends both:
#   1) a matmul rounds a row differently when few rows share the call (torch's bf16 CPU
#      kernels: 334 of 4,050 rows of SmolLM2's down projection alone against in a verify; 2
#      to 6 of 3,000 rows of a 64 -> 24 or 32 projection in 2 rows against 3 or more, Zen 4).
#      So every linear pads a product of fewer than EXACT_MIN_ROWS rows with copies of its
#      first row: a decode step and a short chain's verify take a tree verify's kernel,
#      which rounds a row alike whatever the row count and the row's place in the call. The
#      router's fp32 product rounds a row differently once 4 rows share a call (exact-probe,
#      AVX2 EPYC: 30 of 36 rows), so it runs row by row, each row a padded call of its own;
#   2) fused attention gives a query other bits when masked keys sit beside its own. So each
#      query row attends alone, in fp32, over exactly the keys its mask shows, gathered in
#      slot order into a fresh tensor: the call its decode step makes. The prefill (every key
#      new) attends in one call over fresh fp32 copies. MLA expands its latent with kv_b_proj
#      (a row-invariant linear) and attends per row the same way.
# Under TP at W >= 3 a ring all-reduce orders the sum by message chunks, and a verify's
# message is longer than a decode step's, so the exact path sums the gathered partials in
# rank order (W = 2 is one addition). The drafter is left as it is: its rounding decides
# only which drafts are verified, never which tokens are emitted.


EXACT_MIN_ROWS = 4   # the fewest rows a product of the exact path runs with


def rows_linear(x, weight, bias=None):
    """F.linear, with fewer than EXACT_MIN_ROWS rows of x padded to that many with copies
    of the first (the many-row kernel)."""
    rows = x.reshape(-1, x.shape[-1])                                  # (M, in)
    if not 0 < len(rows) < EXACT_MIN_ROWS:
        return F.linear(x, weight, bias)
    padded = torch.cat([rows, rows[:1].expand(EXACT_MIN_ROWS - len(rows), -1)])
    return F.linear(padded, weight, bias)[:len(rows)].view(*x.shape[:-1], -1)


class RowInvariantLinear(nn.Module):
    """An nn.Linear (the same weight and bias) whose products run with at least
    EXACT_MIN_ROWS rows."""

    def __init__(self, linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return rows_linear(x, self.weight, self.bias)


def each_row_linear(x, weight):
    """F.linear of x (N, D), each row in its own (padded) call, whatever the row count."""
    return torch.cat([rows_linear(row[None], weight) for row in x]) if len(x) else x @ weight.T


def fp32_copy(x):
    """A fresh contiguous fp32 copy: the same layout whatever cache slab it was read from."""
    return x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def time_major(x, slots, length):
    """An fp32 buffer (length, heads, .) holding x (heads, S, .)'s `slots` first."""
    buffer = x.new_empty(length, x.shape[0], x.shape[-1], dtype=torch.float32)
    buffer[:len(slots)] = x.index_select(1, slots).transpose(0, 1)
    return buffer


def attend_rows(q, k, v, bias, scale=None):
    """The exact path's attention core, in fp32: after a prefill, each query row of q
    (B, H, T, hs) alone over the slots of k, v (B, Hkv, S, .) its bias shows, in order.
    A sequence's rows share their cached slots (the prefix), copied once into a time-major
    buffer; each row's branch is written after it, so every row, decode step or verify,
    reads buffer[:n]: the same call with the same strides."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    if T == S:   # the prefill: every key is new, one call over fresh copies
        return attend(fp32_copy(q), fp32_copy(k), fp32_copy(v), fp32_copy(bias), scale).to(q.dtype)
    start = S - T                                        # the new slots come last
    seen = (bias == 0).reshape(-1, T, S).expand(B, T, S)                         # (B, T, S)
    y = q.new_empty(B, H, T, v.shape[-1], dtype=torch.float32)                   # (B, H, T, .)
    for b in range(B):
        cached = seen[b, :, :start]
        if not torch.equal(cached, cached[:1].expand_as(cached)):
            fail("the exact path attends rows that share their cached slots (decode steps, "
                 "chains and trees after a prefill); this mask gives rows different ones")
        prefix = cached[0].nonzero()[:, 0]
        p = len(prefix)
        kb, vb = time_major(k[b], prefix, p + T), time_major(v[b], prefix, p + T)
        for t, new in enumerate(seen[b, :, start:]):
            branch = start + new.nonzero()[:, 0]
            n = p + len(branch)
            kb[p:n] = k[b].index_select(1, branch).transpose(0, 1)
            vb[p:n] = v[b].index_select(1, branch).transpose(0, 1)
            y[b, :, t] = attend(fp32_copy(q[b:b + 1, :, t:t + 1]), kb[None, :n].transpose(1, 2),
                                vb[None, :n].transpose(1, 2), None, scale)[0, :, 0]
    return y.to(q.dtype)


def sum_in_rank_order(x):
    """all_reduce in place in a fixed order, ((x0 + x1) + x2) + ...: a row's sum has the
    same bits in a decode step and in a verify, and on every rank."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return x.copy_(sum(parts[1:], parts[0]))   # sum() adds left to right from its start


EXACT_WEIGHTED = (nn.Linear, RowInvariantLinear, nn.Embedding, RMSNorm, Router)  # the
                                        # modules with weights the exact path knows how to serve


def make_exact(target):
    """Serve `target` on the exact path, in place (idempotent) -> the same target: every
    verify row produces the bits of its own decode step."""
    if not isinstance(target, Target):
        fail(f"make_exact serves a target (a Target), got {type(target).__name__}; the "
             f"drafter stays as it is (its rounding only decides which drafts are verified)")
    for name, module in target.named_modules():     # refused before anything changes
        if list(module.parameters(recurse=False)) and type(module) not in EXACT_WEIGHTED:
            fail(f"make_exact has no row-invariant form of {name!r} "
                 f"({type(module).__name__}); serve the target with nn.Linear layers")
    for module in list(target.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, RowInvariantLinear(child))
        if isinstance(module, (Attention, MLAttention)):
            module.attend = attend_rows
        if isinstance(module, Router):
            module.product = each_row_linear
    if target.tp.size > 2:   # W = 2: one addition, in either order the same bits
        group = target.tp._replace(reduce=sum_in_rank_order)
        for module in target.modules():
            if hasattr(module, "tp"):
                module.tp = group
    return target


# ----------------------------------------------------------------------------------------
# 17. config and checkpoint IO: transformers configs, safetensors / .bin, sharded loading

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3",   # config.json model_type
                      "deepseek_v3", "kimi_k2", "kimi_k25")     # the last two: deepseek_v3
DRAFT_ROPE_BASE = 10000.0   # draft RoPE base when its config.json has no rope_theta (the
                            # released LLaMA-3.1 drafter), whatever the target uses
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")


def shard_dim(name):
    """The dimension of checkpoint tensor `name` a rank slices (the table of section 5)."""
    if any(p in name for p in COLUMN_PARALLEL):
        return 0
    if any(p in name for p in ("o_proj", "down_proj")):
        return 1
    return None


def rope_inv_freq(hf_config):
    """RoPE inverse frequencies and cos/sin scale, exactly as transformers computes them:
    scaled types from its own table (no scaling rule re-derived), the default written here."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = hf_config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = hf_config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        fail(f"rope_type={rope_type!r} is not supported; valid: default, "
             f"{', '.join(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv_freq.float(), float(scale)


def check_head_dim(head_dim, where):
    if head_dim % 2:
        fail(f"{where} gives head_dim={head_dim}: RoPE rotates pairs of dims, so it must be "
             f"even (set head_dim, or heads that divide hidden_size into even widths)")


def mla_config(c):
    """MLA sizes of a DeepseekV3Config; the softmax scale as transformers computes it."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    rope = c.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor, mscale = rope["factor"], rope["mscale_all_dim"]   # YaRN's mscale, squared
        scale *= (0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0) ** 2
    # transformers builds q_a/kv_a_layernorm without an eps: 1e-6 whatever rms_norm_eps
    # says (SGLang and vLLM use rms_norm_eps; they differ for Kimi-K2.5's 1e-5)
    return MLAConfig(q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                     qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                     v_head_dim=c.v_head_dim, softmax_scale=scale, latent_eps=1e-6,
                     rope_interleave=bool(getattr(c, "rope_interleave", True)))


def moe_config(c):
    """MoE sizes of a DeepseekV3Config, refused when its routing cannot select."""
    E, G, K, kept = c.n_routed_experts, c.n_group, c.num_experts_per_tok, c.topk_group
    for key, valid in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if getattr(c, key, valid) != valid:
            fail(f"{key}={getattr(c, key)!r} is not supported; DeepSeek-V3 routing is "
                 f"{key}={valid!r}")
    if E % G or E // G < 2 or not 0 < kept <= G:
        fail(f"n_routed_experts={E}, n_group={G}, topk_group={kept}: the experts must split "
             f"into n_group groups of at least 2 (a group scores its top 2), 0 < topk_group "
             f"<= n_group")
    if kept * (E // G) < K:
        fail(f"routing cannot select num_experts_per_tok={K} experts: topk_group * "
             f"n_routed_experts / n_group = {kept} * {E} / {G} = {kept * E // G} allowed")
    return MoEConfig(n_routed=E, n_shared=c.n_shared_experts, top_k=K, n_group=G, topk_group=kept,
                     width=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                     scaling=c.routed_scaling_factor, first_dense=c.first_k_dense_replace)


def target_config(c):
    """A transformers config object -> TargetConfig."""
    family = c.model_type
    if getattr(c, "hidden_act", "silu") != "silu":
        fail(f"hidden_act={c.hidden_act!r} is not supported; only 'silu' (SwiGLU MLP)")
    attention_bias = family != "qwen2" and getattr(c, "attention_bias", False)
    if getattr(c, "mlp_bias", False) or attention_bias:
        fail("attention_bias/mlp_bias=True is not supported; these families ship without them")
    # Sliding-window attention equals full attention while the cache fits in the window,
    # so we keep the cache inside the window instead of implementing the window.
    window = getattr(c, "sliding_window", None) if family == "mistral" else (
        c.sliding_window if getattr(c, "use_sliding_window", False) else None)
    max_positions = min(c.max_position_embeddings, window or c.max_position_embeddings)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    c.head_dim = head_dim   # DeepSeek-V3's config sets it to qk_rope_head_dim: MLA's rotary dims
    check_head_dim(head_dim, f"the {family} target's config")
    deepseek = family == "deepseek_v3"
    inv_freq, rope_scale = rope_inv_freq(c)
    return TargetConfig(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=head_dim,
        intermediate_size=c.intermediate_size, rms_eps=c.rms_norm_eps, qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3", tie_embeddings=bool(c.tie_word_embeddings),
        max_positions=max_positions, inv_freq=inv_freq, rope_scale=rope_scale,
        mla=mla_config(c) if deepseek else None, moe=moe_config(c) if deepseek else None)


def read_config_json(path):
    if not os.path.isfile(os.path.join(path, "config.json")):
        fail(f"no config.json in {path!r}: expected a Hugging Face model directory")
    return read_json(os.path.join(path, "config.json"))


def text_config(raw):
    """The text model's config: Kimi-K2.5 (kimi_k25) wraps it in text_config."""
    return raw["text_config"] if raw.get("model_type") == "kimi_k25" else raw


def validated(make_config, what):
    """A transformers config, its (chained, multi-line) validation error made one line."""
    try:
        return make_config()
    except Exception as e:  # ValueError, TypeError, huggingface_hub's validation error
        cause = e.__cause__ or e
        fail(f"{what} is not a valid config: {str(cause).strip().splitlines()[-1].strip()}")


def read_target_config(path):
    """config.json of a Hugging Face model dir -> TargetConfig (via transformers' configs);
    kimi_k2 and kimi_k25 are read as the DeepseekV3Config they are (no remote code runs)."""
    from transformers import AutoConfig, DeepseekV3Config
    raw = read_config_json(path)
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        fail(f"model_type={family!r} in {path}/config.json is not supported; "
             f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    if family not in ("deepseek_v3", "kimi_k2", "kimi_k25"):
        return target_config(validated(lambda: AutoConfig.from_pretrained(path),
                                       f"{path}/config.json"))
    text = text_config(raw)
    if text.get("qk_rope_head_dim", 0) % 2:
        fail(f"qk_rope_head_dim={text['qk_rope_head_dim']} in {path}/config.json must be even: "
             f"RoPE rotates pairs of dims")
    drop = ("model_type", "architectures", "auto_map", "quantization_config")
    return target_config(validated(lambda: DeepseekV3Config.from_dict(
        {k: v for k, v in text.items() if k not in drop}), f"{path}/config.json (DeepSeek-V3)"))


class BinWeights(dict):
    """A .bin file's state dict, read through safetensors' get_slice."""
    get_slice = dict.__getitem__


def open_weights(file):
    """A lazy handle with .keys() and .get_slice(name) (.bin files are memory-mapped)."""
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open
            return safe_open(file, framework="pt")
        return BinWeights(torch.load(file, map_location="cpu", mmap=True, weights_only=True))
    except Exception as e:  # safetensors/pickle raise many types; all mean "corrupt"
        fail(f"cannot read weight file {file!r} ({why(e)}); "
             f"the file is corrupt or truncated, re-download or re-save it")


def weight_files(path):
    """{checkpoint key: file} of a model dir: one file or a sharded index, safetensors or .bin."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(path, index)):
            weight_map = read_json(os.path.join(path, index))["weight_map"]
            return {k: os.path.join(path, f) for k, f in weight_map.items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        file = os.path.join(path, single)
        if os.path.isfile(file):
            return {k: file for k in open_weights(file).keys()}
    fail(f"no weights in {path!r}: expected model.safetensors, model.safetensors.index.json, "
         f"pytorch_model.bin or pytorch_model.bin.index.json")


def slice_bounds(n, rank, world):
    return rank * n // world, (rank + 1) * n // world


class Checkpoint:
    """The weights of a model dir, read tensor by tensor, each rank only its slice. `prefix`
    selects a wrapped text model (Kimi-K2.5: "language_model."; other keys: `outside`).
    With `fp8_block` (rows, cols), float8 weights are dequantised on read (_scale_inv)."""

    def __init__(self, path, prefix="", fp8_block=None):
        self.path, self.prefix, self.fp8_block, self.handles = path, prefix, fp8_block, {}
        files = weight_files(path)
        self.files = {k[len(prefix):]: f for k, f in files.items()
                      if k.startswith(prefix) and not k.endswith("_scale_inv")}
        self.outside = sorted(k for k in files if not k.startswith(prefix))
        self.scaled = {k[len(prefix):-len("_scale_inv")] for k in files
                       if k.startswith(prefix) and k.endswith("_scale_inv")}

    def handle(self, file):
        if file not in self.handles:
            self.handles[file] = open_weights(file)
        return self.handles[file]

    def keys(self):
        return self.files.keys()

    def read(self, name, dim=None, rank=0, world=1):
        """The whole tensor, or this rank's 1/W of its rows (dim 0) or columns (dim 1)."""
        file = self.files[name]
        try:
            t = self.handle(file).get_slice(self.prefix + name)
            shape = t.get_shape() if hasattr(t, "get_shape") else t.shape
            lo, hi = slice_bounds(shape[dim], rank, world) if dim is not None else (0, 0)
            x = t[:] if dim is None else t[lo:hi] if dim == 0 else t[:, lo:hi]
            return self.dequantise(name, x, dim, lo) if name in self.scaled else x
        except Eagle3Error:
            raise
        except Exception as e:
            fail(f"cannot read {name!r} from {file!r} ({why(e)}); "
                 f"the file is corrupt or truncated")

    def dequantise(self, name, x, dim, lo):
        """FP8 block dequantisation of the slice x that starts at row/col `lo` along `dim`:
        weight = float(fp8) * the scale_inv of its (rows, cols) block."""
        if self.fp8_block is None:
            fail(f"{name}_scale_inv is in {self.path!r} but config.json has no FP8 "
                 f"quantization_config with weight_block_size")
        b0, b1 = self.fp8_block
        scale = self.handle(self.files[name]).get_slice(self.prefix + name + "_scale_inv")
        # the scale blocks this slice touches (a whole tensor: lo = 0), then one per element
        if dim == 1:
            s, r, c = scale[:, lo // b1:-(-(lo + x.shape[1]) // b1)], 0, lo % b1
        else:
            s, r, c = scale[lo // b0:-(-(lo + x.shape[0]) // b0)], lo % b0, 0
        s = s.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        return x.float() * s[r:r + x.shape[0], c:c + x.shape[1]]


def load_state(module, ckpt, rank, world, skip=lambda name: False, tied=False):
    """Strict key-for-key load of a Checkpoint into `module`, each rank reading only its
    slice (shard_dim). `skip` names keys the caller fills itself. Tolerated extras: old HF
    rotary buffers, and a tied model's lm_head.weight (ignored, as transformers does)."""
    params = dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers()])
    expected = {k for k in params if not skip(k) and not (tied and k == "lm_head.weight")}
    ignorable = {k for k in ckpt.keys() if skip(k) or k.endswith("rotary_emb.inv_freq") or
                 (tied and k == "lm_head.weight")}
    missing = sorted(expected - set(ckpt.keys()))
    unexpected = sorted(set(ckpt.keys()) - expected - ignorable)
    if missing or unexpected:
        fail(f"checkpoint {ckpt.path!r} does not match the model: missing keys {missing[:5]}"
             f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
             f"{' ...' if len(unexpected) > 5 else ''}")
    for name in sorted(expected):
        p = params[name]
        t = ckpt.read(name, shard_dim(name), rank, world)
        if tuple(t.shape) != tuple(p.shape):
            fail(f"{name!r} in {ckpt.path!r} has shape {tuple(t.shape)} (this rank's slice), "
                 f"the model expects {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t.to(p.dtype) if p.is_floating_point() else t)


def default_dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_dtype(name):
    dtypes = dict(float32=torch.float32, fp32=torch.float32, bfloat16=torch.bfloat16,
                  bf16=torch.bfloat16, float16=torch.float16, fp16=torch.float16)
    if name is not None and name not in dtypes:
        fail(f"--dtype {name!r} is not one of {', '.join(dtypes)}")
    return dtypes.get(name)


def target_checkpoint(path):
    """The Checkpoint of a target dir: its text model's key prefix (Kimi-K2.5: language_model.)
    and quantisation (FP8 blocks are dequantised on load; anything else is refused)."""
    raw = read_config_json(path)
    quant = text_config(raw).get("quantization_config") or raw.get("quantization_config")
    if quant and (quant.get("quant_method") != "fp8" or
                  len(quant.get("weight_block_size") or []) != 2):
        fail(f"{path}/config.json has quantization_config with quant_method="
             f"{quant.get('quant_method')!r}, format={quant.get('format', quant.get('fmt'))!r}"
             f" (keys {sorted(quant)}); only FP8 block quantisation (quant_method 'fp8' with "
             f"weight_block_size) is read: dequantise the checkpoint to bf16 first")
    return Checkpoint(path, prefix="language_model." if raw.get("model_type") == "kimi_k25"
                      else "", fp8_block=tuple(quant["weight_block_size"]) if quant else None)


def report_weight_bytes(target, path, dtype, world, device):
    """Before anything is allocated, rank 0 says what each rank will hold (real checkpoints),
    and a GPU that cannot hold it is refused now, not by an out-of-memory error mid-load."""
    params = list(target.parameters()) + list(target.buffers())
    size = sum(p.numel() * (4 if p.dtype == torch.float32 else dtype.itemsize) for p in params)
    if size >= 2**30 or world > 1 or device.type == "cuda":
        n = sum(p.numel() for p in params)
        count = f"{n / 1e9:,.2f}B" if n >= 1e8 else f"{n / 1e6:,.2f}M"
        print0(f"{path}: {target.cfg.family}, {count} parameters = {size / 2**30:,.2f} GiB in "
               f"{str(dtype)[6:]} on each of {world} rank(s)", file=sys.stderr)
    if device.type == "cuda" and size > torch.cuda.mem_get_info(device)[1]:
        fail(f"the weights of {path!r} need {size / 2**30:.1f} GiB on each of {world} ranks but "
             f"a GPU has {torch.cuda.mem_get_info(device)[1] / 2**30:.1f} GiB; use more ranks")


def in_model_dtype(target, dtype):
    """The model cast to `dtype`, except the MoE routers, which stay fp32 (as transformers)."""
    target.to(dtype)
    for module in target.modules():
        if isinstance(module, Router):
            module.float()
    return target


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_sizes(cfg, world):
    if cfg.n_heads % world or cfg.n_kv_heads % world:
        fail(f"num_attention_heads={cfg.n_heads} and num_key_value_heads={cfg.n_kv_heads} "
             f"must both be divisible by the world size {world}; "
             f"use --nproc_per_node in {divisors(math.gcd(cfg.n_heads, cfg.n_kv_heads))}")
    widths = dict(intermediate_size=cfg.intermediate_size)
    if cfg.moe:
        widths.update(moe_intermediate_size=cfg.moe.width,
                      shared_experts_width=cfg.moe.width * cfg.moe.n_shared)
    for name, width in widths.items():
        if width % world:
            fail(f"{name}={width} is not divisible by the world size {world}; "
                 f"use --nproc_per_node in {divisors(width)[:8]}")


def load_target(path, dtype=None, device=None):
    """HF model dir -> Target, sharded over the current TP group (W = 1 without torchrun)."""
    rank, world = world_info()
    cfg = read_target_config(path)
    check_tp_sizes(cfg, world)
    device = torch.device(device) if device else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    dtype = dtype or default_dtype(device)
    ckpt = target_checkpoint(path)
    with torch.device("meta"):
        target = in_model_dtype((DeepSeekTarget if cfg.mla else Target)(cfg, world), dtype)
    report_weight_bytes(target, path, dtype, world, device)
    target = target.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty breaks the tie; restore it
        target.lm_head.weight = target.model.embed_tokens.weight
    # DeepSeek-V3's multi-token-prediction layer (model.layers.L) is not used: EAGLE-3
    # drafts with its own head. Kimi-K2.5's vision tower sits outside language_model.
    mtp = f"model.layers.{cfg.n_layers}."
    skipped = [k for k in ckpt.keys() if k.startswith(mtp)]
    for what, keys in (("MTP layer " + mtp + "*", skipped), ("non-text", ckpt.outside)):
        if keys:
            print0(f"{path}: ignoring {len(keys)} {what} weights", file=sys.stderr)
    load_state(target, ckpt, rank, world, skip=lambda name: name.startswith(mtp),
               tied=cfg.tie_embeddings)
    return target.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------
# 18. drafter IO: official and SpecForge layouts, fresh drafters with a vocab map

DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
# Flags of drafter variants (EAGLE-3.1's norms; vLLM's GPT-OSS speculators; biases) that
# change what the drafter computes: refused, as this reference computes plain EAGLE-3.
VARIANT_DRAFT_FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual",
                       "attention_bias", "mlp_bias")
# How engines read a drafter's eagle_aux_hidden_state_layer_ids, as transformers
# hidden_states indices (= the input of that decoder layer): SpecForge trains on the output
# of layer k = hidden_states[k+1]; vLLM and llama.cpp (which reads only top-level ids) take
# them as input indices; SGLang adds 1 only when the first id is 1 (since
# sgl-project/sglang#25454, May 2026) and always before. Without ids every engine reads the
# default (2, L//2, L-3), so save_draft omits them there; other ids are written for one
# engine and the config names it under AUX_IDS_CONVENTION_KEY (engines ignore the key; our
# reader takes the ids in that convention).
AUX_CONVENTIONS = ("specforge", "vllm", "sglang", "sglang-legacy", "llama.cpp")
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
AUX_IDS_CONVENTION_KEY = "eagle_aux_hidden_state_layer_ids_convention"


def owned(draft, name):
    """Is parameter/buffer `name` the drafter's own (initialised, saved, loaded)? All but
    a shared embedding, which belongs to the target."""
    return draft.own_embedding or not name.startswith("embed_tokens")


def aux_inputs(ids, convention="specforge"):
    """The hidden_states indices the ids name under `convention`."""
    if convention not in AUX_CONVENTIONS:
        fail(f"aux convention {convention!r} is not one of {', '.join(AUX_CONVENTIONS)}")
    shift = {"specforge": 1, "vllm": 0, "sglang": int(ids[0] == 1), "sglang-legacy": 1,
             "llama.cpp": 0}
    return tuple(k + shift[convention] for k in ids)


def aux_ids_for(layers, convention):
    """The ids an engine reading `convention` takes as the hidden_states indices `layers`
    (aux_inputs inverted: every id shifted alike, checked by reading it back)."""
    for shift in (1, 0):
        ids = [k - shift for k in layers]
        if min(ids) >= 0 and aux_inputs(ids, convention) == tuple(layers):
            return ids
    fail(f"aux layers {list(layers)} cannot be written in {convention}'s convention (its ids "
         f"read as other layers); save the drafter for another engine")


def aux_layer_ids(raw):
    """eagle_config.eagle_aux_hidden_state_layer_ids of a draft config, or None."""
    return (raw.get("eagle_config") or {}).get(AUX_IDS_KEY)


def declared_aux_convention(raw):
    """The convention a config says its ids are in (ours, when saved for an engine), else
    SpecForge's, the one every drafter trained here was saved in before it was named."""
    return (raw.get("eagle_config") or {}).get(AUX_IDS_CONVENTION_KEY, "specforge")


def draft_llama_config(raw, where):
    """A drafter's config.json, as transformers' LlamaConfig, with the draft RoPE base."""
    from transformers import LlamaConfig
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in DRAFT_ARCHITECTURES:
        fail(f"draft architectures={raw.get('architectures')} is not an EAGLE-3 Llama drafter; "
             f"expected one of {DRAFT_ARCHITECTURES}")
    c = validated(lambda: LlamaConfig.from_dict(
        {k: v for k, v in raw.items() if k != "architectures"}), where)
    if raw.get("num_hidden_layers", 1) != 1:
        fail(f"draft num_hidden_layers={raw['num_hidden_layers']}: an EAGLE-3 drafter has one "
             f"decoder layer")
    if "rope_theta" not in raw and "rope_parameters" not in raw:
        c.rope_parameters = {"rope_type": "default", "rope_theta": DRAFT_ROPE_BASE}
    return c


def read_draft_config(path_or_dict, target_cfg, weight_keys=None, aux_convention=None):
    """Draft config.json (official or SpecForge layout) -> DraftConfig, checked against its
    target; aux-layer ids read in `aux_convention` (None: the one the config declares, else
    SpecForge's). Given `weight_keys`, a full-vocab drafter without d2t/t2d weights has the
    identity map, as the official loader reads it."""
    given = isinstance(path_or_dict, dict)
    where = "the drafter config" if given else os.path.join(path_or_dict, "config.json")
    raw = path_or_dict if given else read_json(where)
    c = draft_llama_config(raw, where)
    if c.vocab_size != target_cfg.vocab_size:
        fail(f"draft vocab_size={c.vocab_size} != target vocab_size={target_cfg.vocab_size}: "
             f"this drafter was trained for another target")
    target_hidden = raw.get("target_hidden_size", c.hidden_size)
    if target_hidden != target_cfg.hidden_size:
        fail(f"draft expects target hidden size {target_hidden} (fc input 3*{target_hidden}) "
             f"but the target has hidden_size={target_cfg.hidden_size}")
    variant = {k: raw[k] for k in VARIANT_DRAFT_FLAGS if raw.get(k)}
    if raw.get("logit_scale", 1.0) != 1.0:
        variant["logit_scale"] = raw["logit_scale"]
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        variant["use_aux_hidden_state"] = False
    if variant:   # read as plain EAGLE-3, such a drafter would draft from other numbers
        fail(f"{where} sets {variant}: a variant of the EAGLE-3 drafter (EAGLE-3.1's norms, "
             f"an engine's extras) that this reference does not compute")
    ids = aux_layer_ids(raw)
    aux_convention = aux_convention or declared_aux_convention(raw)
    aux_layers = aux_inputs(ids, aux_convention) if ids else target_cfg.default_aux_layers
    check_aux_layers(aux_layers, target_cfg.n_layers)
    draft_vocab_size = raw.get("draft_vocab_size", c.vocab_size)
    stored_map = weight_keys is None or bool({"d2t", "t2d"} & set(weight_keys))
    has_vocab_map = "draft_vocab_size" in raw and (draft_vocab_size != c.vocab_size or stored_map)
    head_dim = raw.get("head_dim") or c.hidden_size // c.num_attention_heads
    check_head_dim(head_dim, where)
    inv_freq, rope_scale = rope_inv_freq(c)
    return DraftConfig(
        hidden_size=c.hidden_size, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=head_dim,
        intermediate_size=c.intermediate_size, rms_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab_size, target_hidden_size=target_hidden, aux_layers=aux_layers,
        aux_default=aux_layers == target_cfg.default_aux_layers, has_vocab_map=has_vocab_map,
        inv_freq=inv_freq, rope_scale=rope_scale, raw=raw)


def check_vocab_map(d2t, t2d, V, where):
    """d2t must map draft ids injectively into the target vocab and t2d must mark exactly
    those ids: the official loader's strict=False hides a broken map behind an identity."""
    Vd = d2t.numel()
    target_ids = torch.arange(Vd, device=d2t.device) + d2t
    bad = ((target_ids < 0) | (target_ids >= V)).nonzero()
    if len(bad):
        i = int(bad[0])
        fail(f"{where}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the "
             f"target vocab [0, {V}) ({len(bad)} such ids); the drafter does not fit this target")
    if target_ids.unique().numel() != Vd:
        fail(f"{where}: d2t maps two draft ids to the same target id; it must be injective")
    if t2d.numel() != V or int(t2d.sum()) != Vd or not bool(t2d[target_ids].all()):
        fail(f"{where}: t2d disagrees with d2t: t2d marks {int(t2d.sum())} of {t2d.numel()} "
             f"target ids, d2t maps {Vd} draft ids into a {V}-token vocab; t2d[i + d2t[i]] "
             f"must be True exactly for the mapped ids")


def new_draft(cfg, target, own_embedding=False, dtype=None):
    """An (uninitialised) drafter on the target's device, sharing its embedding."""
    device = target.lm_head.weight.device
    with torch.device("meta"):
        draft = Draft(cfg, shared_embedding=None if own_embedding else target.model.embed_tokens)
    for name, child in draft.named_children():   # allocate all but the shared embedding
        if owned(draft, name):
            child.to_empty(device=device).to(dtype or target.lm_head.weight.dtype)
    for name, buf in draft.named_buffers(recurse=False):
        setattr(draft, name, torch.empty_like(buf, device=device))
    return draft


def init_weights(module, seed, std=0.02, skip=lambda name: False):
    """Fresh weights from a seeded CPU generator (alike on every rank): norms 1, N(0, std)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not skip(name):
                matrix = p.dim() > 1
                p.copy_(torch.randn(p.shape, generator=g) * std if matrix else torch.ones(p.shape))
    return module


def fresh_draft(cfg, target, seed, vocab_map=None, dtype=None):
    """A newly initialised drafter for `target` with its vocab map (d2t, t2d) filled in."""
    draft = new_draft(cfg, target, dtype=dtype)
    init_weights(draft, seed, skip=lambda name: not owned(draft, name))  # not a shared embedding
    if vocab_map is not None:
        with torch.no_grad():
            draft.d2t.copy_(vocab_map[0].to(draft.d2t.device))
            draft.t2d.copy_(vocab_map[1].to(draft.t2d.device))
    return draft


def load_draft(path, target, dtype=None, aux_convention=None):
    """EAGLE-3 drafter dir (official or SpecForge layout) -> Draft, replicated on every rank.
    Strict (keys, shapes, d2t/t2d); its aux-layer ids are read in `aux_convention` (None: the
    one its config declares, else SpecForge's; an engine's name: as that engine reads them)."""
    ckpt = Checkpoint(path)
    cfg = read_draft_config(path, target.cfg, weight_keys=ckpt.keys(),
                            aux_convention=aux_convention)
    own = "embed_tokens.weight" in ckpt.keys()
    if not own and cfg.hidden_size != target.cfg.hidden_size:
        fail(f"draft hidden_size={cfg.hidden_size} differs from the target's "
             f"{target.cfg.hidden_size}, so it needs its own embed_tokens.weight in {path!r}")
    draft = new_draft(cfg, target, own_embedding=own, dtype=dtype)
    load_state(draft, ckpt, 0, 1, skip=lambda name: not owned(draft, name))
    if cfg.has_vocab_map:
        check_vocab_map(draft.d2t, draft.t2d, cfg.vocab_size, path)
    return draft.eval().requires_grad_(False)


def saved_eagle_config(cfg, engine):
    """eagle_config as saved for `engine`: no ids for the default layers (every engine reads
    those alike), else the ids that engine reads as the trained layers, and their convention."""
    eagle = {k: v for k, v in (cfg.raw.get("eagle_config") or {}).items()
             if k not in (AUX_IDS_KEY, AUX_IDS_CONVENTION_KEY)} | {"use_aux_hidden_state": True}
    if not cfg.aux_default:
        eagle[AUX_IDS_KEY] = aux_ids_for(cfg.aux_layers, engine)
        eagle[AUX_IDS_CONVENTION_KEY] = engine
    return eagle


def save_draft(draft, path, engine="specforge"):
    """Official/SpecForge layout: config.json + model.safetensors (no frozen embedding);
    aux ids that `engine` reads as the layers the drafter was trained on."""
    from safetensors.torch import save_file
    if not is_rank0():
        return
    cfg = draft.cfg
    eagle = saved_eagle_config(cfg, engine)   # llama.cpp: its ids at the top level too
    top = {k: v for k, v in eagle.items() if k == AUX_IDS_KEY and engine == "llama.cpp"}
    raw = dict({k: v for k, v in cfg.raw.items() if k != AUX_IDS_KEY}, **top, eagle_config=eagle,
               architectures=["LlamaForCausalLMEagle3"], vocab_size=cfg.vocab_size,
               num_hidden_layers=1)   # engines build that many layers (else transformers' 32)
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()
             if owned(draft, k)}
    atomic_write(os.path.join(path, "model.safetensors"), lambda f: save_file(state, f))
    atomic_write(os.path.join(path, "config.json"), lambda f: write_json(f, raw))


def draft_config_for(target, draft_vocab_size):
    """A new drafter shaped like one target layer (as the released drafters are)."""
    c = target.cfg
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
               rms_norm_eps=c.rms_eps, rope_theta=DRAFT_ROPE_BASE,
               max_position_embeddings=c.max_positions, vocab_size=c.vocab_size,
               draft_vocab_size=draft_vocab_size, tie_word_embeddings=False)
    return read_draft_config(raw, c)


# ----------------------------------------------------------------------------------------
# 19. training data and the training loop (checkpoints, resume, held-out accuracy)
#
# The naive loop around Part I's TTT loss: AdamW with warmup and cosine decay, gradient
# clipping, the drafter data-parallel over the ranks (one all_reduce per gradient).

GRAD_CLIP = 0.5             # max gradient norm
ADAM_BETAS = (0.9, 0.95)    # AdamW betas; weight decay 0


class Example(NamedTuple):
    tokens: list       # prompt + reply token ids
    reply_mask: list   # 1 where the token belongs to an assistant reply


def build_vocab_mapping(token_counts, draft_vocab_size):
    """Keep the draft_vocab_size most frequent target tokens (ties: smaller id first; ids
    never seen fill up in ascending order), sorted ascending: draft id i <-> used[i].
    Returns d2t (offsets: target id = i + d2t[i]) and t2d (bool over the target vocab)."""
    counts = torch.as_tensor(token_counts)
    V = len(counts)
    if not 0 < draft_vocab_size <= V:
        fail(f"draft_vocab_size={draft_vocab_size} must be in 1..{V} (the target vocab size)")
    # a stable sort keeps equal counts in id order, so unseen ids (count 0) come ascending
    used = torch.sort(-counts, stable=True).indices[:draft_vocab_size].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab_size), t2d


def collate(examples, pad_id):
    """Right-pad to the longest example. loss_mask[t] = 1 when the token that position t
    predicts at TTT step 0, x[t+2], is a reply token (the alignment the official code
    reaches with its hard-coded offsets; later steps shift it along)."""
    T = max(len(ex.tokens) for ex in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)               # (B, T)
    reply = torch.zeros(len(examples), T)
    for i, ex in enumerate(examples):
        ids[i, :len(ex.tokens)] = torch.tensor(ex.tokens)
        reply[i, :len(ex.tokens)] = torch.tensor(ex.reply_mask, dtype=torch.float)
    return ids, shift_left(shift_left(reply))


def count_reply_tokens(examples, vocab_size):
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        tokens = torch.tensor(ex.tokens)[torch.tensor(ex.reply_mask, dtype=torch.bool)]
        counts += torch.bincount(tokens, minlength=vocab_size)
    return counts


def lr_at(step, steps, lr, warmup):
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def trainable(draft):
    """Everything but the embedding, shared or the drafter's own: it stays frozen."""
    return [p for name, p in draft.named_parameters() if not name.startswith("embed_tokens")]


class TTTInputs(NamedTuple):
    """What the TTT loss needs of the target for a padded batch."""
    input_ids: torch.Tensor      # (B, T)
    loss_mask: torch.Tensor      # (B, T) step-0 loss mask (collate)
    target_logits: torch.Tensor  # (B, T, V)
    aux: torch.Tensor            # (B, T, 3*D_t) the features the drafter reads


def ttt_batch(inputs, draft, examples, rank=0, world=1, steps=TTT_STEPS, aux_layers=None):
    """The target's side of the whole batch (TTTInputs from `inputs`: a live, tensor-parallel
    forward, or captured features; at the drafter's aux layers unless `aux_layers`), then
    the TTT loss on this rank's rows, normalised by the *global* B*T so the all-reduced
    gradient is the gradient of the global loss."""
    x = inputs(examples, aux_layers or draft.cfg.aux_layers)
    rows = slice(*slice_bounds(len(x.input_ids), rank, world))
    return ttt_loss(draft, x.aux[rows], x.input_ids[rows], x.loss_mask[rows], x.target_logits[rows],
                    steps, denominator=x.input_ids.numel())


def new_optimizer(draft, cfg):
    """AdamW(0.9, 0.95), no weight decay, over the trainable parameters (all else frozen)."""
    params = trainable(draft)
    draft.train().requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=ADAM_BETAS, weight_decay=0.0)


def train_step(inputs, draft, opt, examples, step, cfg, rank=0, dp=LOCAL):
    """One data-parallel AdamW step of TTT on the global batch `examples` -> TTTResult: loss
    on this rank's rows, gradients summed over `dp`; the forward under autocast if cfg.bf16."""
    params = [p for group in opt.param_groups for p in group["params"]]
    with torch.autocast(params[0].device.type, torch.bfloat16, enabled=cfg.bf16):
        result = ttt_batch(inputs, draft, examples, rank, dp.size, cfg.ttt_steps)
    result.loss.backward()
    for p in params:  # data parallel: sum the shards' gradients
        all_reduce(p.grad, dp)
    torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.warmup)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return result


PROGRESS_LOG_SECONDS = 30  # stderr is a file: one progress line this often, not a redraw


class Progress:
    """A progress line on rank 0: redrawn in place on a terminal; in a log file, where redraws
    would pile up into one endless line, one line every PROGRESS_LOG_SECONDS."""

    def __init__(self, label, total, start=0):
        self.label, self.total, self.last_line = label, total, -math.inf
        self.start, self.t0 = start, time.time()   # a resumed run's earlier steps took no time

    def eta(self, step):
        """'ETA 12m' at the pace since this bar was made; empty before the first step."""
        if step <= self.start:
            return ""
        seconds = (time.time() - self.t0) / (step - self.start) * (self.total - step)
        return f" ETA {seconds / 60:.0f}m" if seconds >= 60 else f" ETA {seconds:.0f}s"

    def show(self, step, **metrics):
        if not is_rank0():
            return
        shown = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in metrics.items())
        line = f"{self.label} {step}/{self.total}{self.eta(step)} {shown}"
        if sys.stderr.isatty():
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        elif time.time() - self.last_line >= PROGRESS_LOG_SECONDS:
            self.last_line = time.time()
            print(line, file=sys.stderr, flush=True)

    def done(self):
        if is_rank0() and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


def conversation(line, where):
    roles = dict(human="user", user="user", gpt="assistant", assistant="assistant", system="system")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        fail(f"{where} is not valid JSON ({e.msg} at column {e.colno}); each line must be one "
             f"JSON object with 'messages' or 'conversations'")
    turns = (row.get("messages") or row.get("conversations")) if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns:
        fail(f"{where} has neither a 'messages' nor a 'conversations' list")
    out = []
    for t in turns:
        content = t.get("content", t.get("value")) if isinstance(t, dict) else None
        if not isinstance(content, str):
            fail(f"{where}: turn {t!r:.60} is not {{role, content}} or {{from, value}} with "
                 f"a text content")
        out.append(dict(role=roles.get(t.get("role", t.get("from")), "user"), content=content))
    return out


def read_conversations(path):
    """JSONL of ShareGPT `conversations` or OpenAI `messages` -> lists of {role, content}."""
    try:
        with open(path, encoding="utf-8") as f:
            return [conversation(line, f"{path}:{line_no}")
                    for line_no, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as e:
        fail(f"--data {path!r} is not UTF-8 text ({e.reason} at byte {e.start})")


def chat_ids(tokenizer, messages, add_generation_prompt=False):
    """The chat-templated token ids (a list; newer transformers wrap them in an encoding)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def tokenize_conversation(tokenizer, messages):
    """Chat-template the conversation; reply_mask marks the tokens of assistant turns,
    found by rendering each prefix (the template must extend its prefixes, as real ones do)."""
    tokens = chat_ids(tokenizer, messages)
    mask = [0] * len(tokens)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat_ids(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        upto = chat_ids(tokenizer, messages[:i + 1])
        if upto[:len(before)] != before or tokens[:len(upto)] != upto:
            fail("the tokenizer's chat template does not extend its prefixes, so assistant "
                 "tokens cannot be located; use a template that renders turns in sequence")
        mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
    return Example(tokens, mask)


def padded_greedy(target, prompts, max_new_tokens, eos_token_id):
    """Batched greedy decoding of prompts (lists of ids) -> lists of new tokens, each cut
    after its first EOS. Left-padded, so every row writes the same cache slot each step;
    pads are masked out (a pad query sees only itself) and positions count from a row's
    first real token, so each row computes what it would alone."""
    device = target.lm_head.weight.device
    B, T = len(prompts), max(len(p) for p in prompts)
    pads = torch.tensor([T - len(p) for p in prompts], device=device)                 # (B,)
    x = torch.tensor([[eos_token_id] * (T - len(p)) + p for p in prompts], device=device)
    slots = torch.arange(T + max_new_tokens, device=device)
    real = slots[None] >= pads[:, None]                                 # (B, T + new) bool
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask = (causal & real[:, None, :T]) | torch.eye(T, dtype=torch.bool, device=device)
    cache = target.new_cache(T + max_new_tokens, batch=B)
    logits, _ = target(x, (slots[None, :T] - pads[:, None]).clamp(min=0), mask, cache, 0, ())
    out, ended = [], torch.zeros(B, dtype=torch.bool, device=device)
    for n in range(T, T + max_new_tokens):
        token = logits[:, -1].argmax(-1)                                               # (B,)
        out.append(token)
        ended |= token == eos_token_id
        if ended.all() or n + 1 == T + max_new_tokens:
            break
        logits, _ = target(token[:, None], (n - pads)[:, None], real[:, None, :n + 1], cache, n, ())
    rows = torch.stack(out, 1).tolist()                                          # (B, new)
    return [r[:r.index(eos_token_id) + 1] if eos_token_id in r else r for r in rows]


@torch.inference_mode()
def regenerate_replies(target, prompts, max_new_tokens, eos_token_id, batch=256):
    """The EAGLE-3 recipe: train on what the target itself says. Greedy replies to prompts
    (lists of ids), batched by prompt length (no padding), each cut after its first EOS."""
    by_length = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    replies, bar, done = [None] * len(prompts), Progress("target replies", len(prompts)), 0
    for length, indices in sorted(by_length.items()):
        for j in range(0, len(indices), batch):
            rows = indices[j:j + batch]
            for i, reply in zip(rows, padded_greedy(target, [prompts[i] for i in rows],
                                                    max_new_tokens, eos_token_id)):
                replies[i] = reply
            done += len(rows)
            bar.show(done)
    bar.done()
    return replies


CURVE_FILE = "curve.json"   # in a training run's out dir: {"points": [curve_point, ...]}
TRAIN_STATE_FILE = "train_state.pt"   # in a training run's out dir, for --resume


class TrainState(NamedTuple):
    step: int = 0          # optimizer steps done
    seconds: float = 0.0   # training time spent on them, over every resumed run
    curve: list = []       # curve_point per held-out evaluation so far


def save_checkpoint(out_dir, draft, opt, state, engine="specforge"):
    """The drafter (save_draft), then train_state.pt: it, the optimizer and TrainState in
    one atomic file, so a resume never mixes steps; then a readable copy of the curve."""
    save_draft(draft, out_dir, engine)
    if is_rank0():
        full = dict(state._asdict(), draft=draft.state_dict(), optimizer=opt.state_dict())
        atomic_write(os.path.join(out_dir, TRAIN_STATE_FILE), lambda f: torch.save(full, f))
        if state.curve:
            atomic_write(os.path.join(out_dir, CURVE_FILE),
                         lambda f: write_json(f, dict(points=state.curve)))


def load_train_state(path, draft, opt):
    """The TrainState to resume from (step 0 before the first checkpoint was written)."""
    if not os.path.exists(path):
        print0(f"--resume: no {path} yet, starting from step 0")
        return TrainState()
    try:
        state = torch.load(path, map_location=draft.fc.weight.device, weights_only=True)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        return TrainState(int(state["step"]), float(state.get("seconds", 0.0)),
                          list(state.get("curve", [])))
    except Exception as e:  # unpickling, missing entries and shape mismatches alike
        fail(f"cannot resume from {path!r} ({why(e)}); the checkpoint "
             f"is truncated, corrupt or not ours: delete it to start over")


class TrainConfig(NamedTuple):
    steps: int = 300
    batch: int = 32          # global batch; each of W data-parallel ranks trains on batch/W
    lr: float = 3e-3
    warmup: int = 20
    ttt_steps: int = TTT_STEPS
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    bf16: bool = False       # mixed precision: the forward's matmuls in bf16 under autocast
                             # (AMX on recent Xeons: ~8x fp32), weights and optimizer in fp32
    save_for: str = "specforge"  # the engine whose convention saved aux ids are in


def check_train_config(cfg):
    for name in ("steps", "batch", "ttt_steps", "eval_every", "save_every"):
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            fail(f"TrainConfig {name}={getattr(cfg, name)!r} must be a positive integer")
    if not cfg.lr > 0:
        fail(f"TrainConfig lr={cfg.lr!r} must be > 0")


def batch_indices(n, batch, step, seed):
    """The examples of step `step`, a function of (seed, step): resuming sees the same ones."""
    per_epoch = max(1, n // batch)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[i * batch:(i + 1) * batch].tolist()


class ChainStats(NamedTuple):
    step_accuracy: list   # per TTT step: correct top-1 drafts / loss-masked positions
    accept_rate: list     # depth d = 1..: P(draft d accepted | drafts 1..d-1 accepted)
    expected_tau: list    # k = 1..: expected accept length of a greedy chain of k drafts
    replayed_tau: list    # k = 1..: mean accept length of chains replayed along the replies


def accepted_runs(result):
    """(B, T): how many drafts of a greedy chain started at t are accepted, from a TTTResult:
    steps 0..d-1 all scored and correct (chain_stats says why)."""
    ok = torch.stack([s & c for s, c in zip(result.scored, result.correct)]).long()  # (steps, B, T)
    return ok.cumprod(0).sum(0)                 # cumprod: steps 0..d all scored and correct


def replay_rounds(accepted, scored):
    """The rounds serving would run along each row (accepted (B, T): drafts accepted of a chain
    started at t): the first drafts the reply's second token, each next one follows a bonus.
    -> per row, [(t, drafts accepted), ...] in order."""
    rounds = []
    for row, live in zip(accepted.tolist(), scored.tolist()):
        starts = [t for t, x in enumerate(live) if x]
        t, kept = (starts[0] + 1 if starts else len(live)), []
        while t < len(live) and live[t]:
            kept.append((t, row[t]))
            t += row[t] + 1
        rounds.append(kept)
    return rounds


def chain_stats(results):
    """Greedy-chain acceptance from TTT results. On the target's own greedy replies, TTT
    step d at t is fed exactly the accepted draft, so draft d is accepted iff steps 0..d-1
    are all correct there: a chain of k drafts expects 1 + sum_{d<=k} prod_{j<=d} rate_j,
    averaged over every start. Served rounds start after the previous round's bonus (more
    often in hard spans when misses cluster), so `replayed_tau` walks the replies so."""
    steps = len(results[0].correct)
    hits, counts, tried, reached = torch.zeros(4, steps)
    rounds = [[] for _ in range(steps)]
    for r in results:
        run = accepted_runs(r)
        for d in range(steps):
            hits[d] += float(r.hits[d])
            counts[d] += float(r.counts[d])
            tried[d] += float(((run >= d) & r.scored[d]).sum())  # drafts 1..d accepted
            reached[d] += float((run > d).sum())
        for k in range(1, steps + 1):
            rounds[k - 1] += [n + 1 for row in replay_rounds(run.clamp(max=k), r.scored[0])
                              for _, n in row]
    rate = (reached / tried.clamp(min=1)).tolist()
    tau = [1 + sum(math.prod(rate[:d + 1]) for d in range(k)) for k in range(1, steps + 1)]
    replayed = [sum(taus) / max(1, len(taus)) for taus in rounds]
    return ChainStats((hits / counts.clamp(min=1)).tolist(), rate, tau, replayed)


@torch.inference_mode()
def evaluate_draft(inputs, draft, examples, steps=TTT_STEPS, batch=32, aux_layers=None):
    """ChainStats of the drafter on held-out examples (every rank computes all of it)."""
    return chain_stats([ttt_batch(inputs, draft, examples[i:i + batch], steps=steps,
                                  aux_layers=aux_layers)
                        for i in range(0, len(examples), batch)])


def curve_point(step, seconds, stats):
    """One held-out evaluation of a training run, as train_state.pt and curve.json keep it."""
    return dict(step=step, train_seconds=round(seconds, 1),
                step_accuracy=[round(a, 4) for a in stats.step_accuracy],
                chain_tau=[round(t, 4) for t in stats.replayed_tau])


def train_draft(inputs, draft, examples, held_out, cfg, out_dir, resume=False):
    """Naive EAGLE-3 training: train_step over seeded batches, data-parallel over the W ranks,
    the target's side from `inputs` (live_inputs or captured_inputs). Every eval_every steps
    the held-out accuracy and tau_sim (greedy chains replayed along the held-out replies);
    every save_every steps save_checkpoint. -> the curve: a curve_point per held-out
    evaluation, with the training time so far."""
    rank, world = world_info()
    dp = new_group(world)
    check_train_config(cfg)
    if cfg.batch % world:
        fail(f"batch={cfg.batch} must be divisible by the world size {world}")
    opt = new_optimizer(draft, cfg)
    start, seconds, curve = (load_train_state(os.path.join(out_dir, TRAIN_STATE_FILE), draft, opt)
                             if resume else TrainState())
    bar, t0, curve = Progress("train draft", cfg.steps, start), time.time() - seconds, list(curve)
    for step in range(start, cfg.steps):
        batch = [examples[i] for i in batch_indices(len(examples), cfg.batch, step, cfg.seed)]
        result = train_step(inputs, draft, opt, batch, step, cfg, rank, dp)
        hits, counts = (all_reduce(torch.stack(x).detach().clone(), dp)   # over the ranks
                        for x in (result.hits, result.counts))
        bar.show(step + 1, loss=float(all_reduce(result.loss.detach().clone(), dp)),
                 **{f"acc{k}": float(a) for k, a in enumerate((hits / counts.clamp(min=1))[:3])})
        last = step + 1 == cfg.steps
        if held_out and ((step + 1) % cfg.eval_every == 0 or last):
            stats = evaluate_draft(inputs, draft, held_out, cfg.ttt_steps, cfg.batch)
            curve.append(curve_point(step + 1, time.time() - t0, stats))
            bar.done()
            print0(f"  held-out draft accuracy per TTT step: "
                   f"{' '.join(f'{a:.3f}' for a in stats.step_accuracy)}")
            print0(f"  held-out tau_sim (greedy chains), 1..{cfg.ttt_steps} drafts: "
                   f"{' '.join(f'{t:.2f}' for t in stats.replayed_tau)}")
        if (step + 1) % cfg.save_every == 0 or last:
            save_checkpoint(out_dir, draft, opt,
                            TrainState(step + 1, time.time() - t0, curve), cfg.save_for)
    bar.done()
    draft.eval().requires_grad_(False)
    return curve


def training_examples(tokenizer, data, max_len, limit=None):
    """The conversations of a JSONL file (its first `limit`) with an assistant turn, as
    Examples of at most max_len tokens (longer ones dropped)."""
    examples = [tokenize_conversation(tokenizer, m) for m in read_conversations(data)[:limit]]
    return [ex for ex in examples if len(ex.tokens) <= max_len and sum(ex.reply_mask)]


def held_out_split(examples):
    """(train, held out): the first 1/50 (at least one) is held out."""
    n_held = max(1, len(examples) // 50)
    return examples[n_held:], examples[:n_held]


def live_inputs(target, pad_id):
    """ttt_batch's inputs computed live: one forward of the frozen target per batch."""
    @torch.no_grad()
    def inputs(examples, aux_layers):
        ids, mask = (t.to(target.lm_head.weight.device) for t in collate(examples, pad_id))
        return TTTInputs(ids, mask, *target(ids, aux_layers=aux_layers))   # logits, aux
    return inputs


# ----------------------------------------------------------------------------------------
# 20. tiny models: a synthetic chat corpus, a tokenizer and a pretrained tiny target
#
# Deterministic and written here, so the demo needs no download. Each conversation is a
# user prompt and an assistant reply from one of a few task families: some replies are a
# function of the prompt (facts, counting, arithmetic, spelling, copying), others contain
# genuinely uncertain spans (stories, lists), so the language is learnable but not trivial.
# The word lists live in tiny_configs/tiny_corpus_words.json.

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}" + ASSISTANT +
                 "{{ m['content'] }}" + END + "{% else %}" + USER + "{{ m['content'] }}"
                 "{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")


# the lookup tasks: kind -> (word list, prompt, reply); {k} is the key drawn, {v} its value
LOOKUP_TASKS = {
    0: ("capitals", "What is the capital of {k}?",
        "The capital of {k} is {v}. Many people in {k} live in {v}, and visitors to {k} often "
        "start their trip in {v}."),
    3: ("colors", "What color is the {k}?",
        "The {k} is {v}. Most people would say that the color of the {k} is {v}."),
    4: ("opposites", "What is the opposite of {k}?",
        "The opposite of {k} is {v}. Something that is not {k} is {v}."),
}


def number_example(g, numbers, kind):
    """Counting (kind 1) or adding (kind 2), the numbers spelled out."""
    if kind == 1:
        a = int(torch.randint(0, 12, (1,), generator=g))
        b = a + int(torch.randint(3, 9, (1,), generator=g))
        return (f"Count from {numbers[a]} to {numbers[b]}.",
                f"Sure, counting from {numbers[a]} to {numbers[b]}: "
                f"{', '.join(numbers[a:b + 1])}. That is {numbers[b - a + 1]} numbers.")
    a, b = (int(x) for x in torch.randint(0, 11, (2,), generator=g))
    x, y, z = numbers[a], numbers[b], numbers[a + b]
    return (f"What is {x} plus {y}?",
            f"{x} plus {y} is {z}. If you have {x} apples and get {y} more, you have {z} apples.")


def corpus_example(g, w):
    """One (prompt, reply) pair drawn with the torch generator g from the word lists w: a
    few sentences, mostly determined by the prompt, with some words drawn at random."""
    def pick(seq):
        return seq[int(torch.randint(len(seq), (1,), generator=g))]
    kind = int(torch.randint(8, (1,), generator=g))
    if kind in LOOKUP_TASKS:
        table, prompt, reply = LOOKUP_TASKS[kind]
        k = pick(list(w[table]))
        return prompt.format(k=k, v=w[table][k]), reply.format(k=k, v=w[table][k])
    if kind in (1, 2):
        return number_example(g, w["numbers"], kind)
    if kind == 5:
        word = pick(w["words"])
        return (f"Spell the word {word}.",
                f"The word {word} is spelled {' '.join(word.upper())}. It has "
                f"{w['numbers'][len(word)]} letters.")
    if kind == 6:
        words = " ".join(pick(w["words"] + w["animals"]) for _ in range(3))
        return f"Repeat after me: {words}.", f"{words}. {words}. {words}."
    name, animal = pick(w["names"]), pick(w["animals"])
    return (f"Tell me a story about {name} the {animal}.",
            f"Once upon a time {name} the {pick(w['adjectives'])} {animal} lived near a "
            f"{pick(w['places'])}. Every day {name} ate {pick(w['foods'])} and "
            f"{pick(w['foods'])}. {name} was {pick(w['adjectives'])} and "
            f"{pick(w['adjectives'])}. The end.")


def synthetic_corpus(n, seed):
    """n (prompt, reply) pairs from the corpus stream `seed`."""
    g = torch.Generator().manual_seed(seed)
    words = read_json(os.path.join(TINY_CONFIGS, "tiny_corpus_words.json"))
    return [corpus_example(g, words) for _ in range(n)]


def chat_text(prompt, reply=None):
    """The tiny chat format; the same string the saved tokenizer's chat template renders."""
    return f"{USER}{prompt}{ASSISTANT}" + ("" if reply is None else f"{reply}{END}")


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (`tokenizers`) as a transformers tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)   # its bars leave blank lines in a log
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=END,
                                   chat_template=CHAT_TEMPLATE)


TINY_DIR = os.path.join(RUNS_DIR, "tiny")
TINY_TOKENIZER_VOCAB = 2048  # BPE merges stop earlier: the corpus yields ~1.3k tokens


class Pretrain(NamedTuple):
    conversations: int = 40000  # synthetic conversations in the pretraining corpus
    row_len: int = 128          # tokens per packed training row
    batch: int = 16
    steps: int = 240            # the tiny target (the workbench's assistant LM takes fewer)
    lr: float = 3e-3
    warmup: int = 30


PRETRAIN = Pretrain()


def next_token_accuracy(target, token_lists):
    """Held-out top-1 accuracy of the target on its own language (all positions)."""
    hits = total = 0
    with torch.no_grad():
        for tokens in token_lists:
            x = torch.tensor([tokens], device=target.lm_head.weight.device)
            logits, _ = target(x, aux_layers=())
            hits += int((logits[0, :-1].argmax(-1) == x[0, 1:]).sum())
            total += x.shape[1] - 1
    return hits / total


def build_lm(path, hf_config, tokenizer, texts, steps, seed):
    """Pretrain a tiny LM (random init; one process: AdamW, clip 1.0, next-token loss on the
    corpus cut into rows) and save it as a real HF model dir (config, weights, tokenizer):
    transformers and load_target read it."""
    from safetensors.torch import save_file
    lm = init_weights(Target(target_config(hf_config)), seed)
    stream = torch.tensor([t for text in texts for t in tokenizer(text).input_ids])
    n = len(stream) // PRETRAIN.row_len * PRETRAIN.row_len
    rows = stream[:n].view(-1, PRETRAIN.row_len)                              # (rows, row_len)
    opt = torch.optim.AdamW(lm.parameters(), lr=PRETRAIN.lr, betas=ADAM_BETAS, weight_decay=0.0)
    g, bar = torch.Generator().manual_seed(seed), Progress("pretrain target", steps)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, PRETRAIN.lr, PRETRAIN.warmup)
        x = rows[torch.randint(len(rows), (PRETRAIN.batch,), generator=g)]
        logits, _ = lm(x, aux_layers=())
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.show(step + 1, loss=loss.item())
    bar.done()
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in lm.state_dict().items()}
    tokenizer.save_pretrained(path)
    atomic_write(os.path.join(path, "model.safetensors"), lambda f: save_file(state, f))
    atomic_write(os.path.join(path, "config.json"), lambda f: write_json(f, hf_config.to_dict()))


def pretraining_texts(seed):
    return [chat_text(p, r) for p, r in synthetic_corpus(PRETRAIN.conversations, seed)]


def build_tiny_target(path, seed=0):
    """Corpus -> tokenizer -> pretrained tiny target saved at `path` (rank 0 builds it)."""
    from transformers import AutoConfig
    t0 = time.time()
    texts = pretraining_texts(seed)
    tokenizer = train_tokenizer(texts, TINY_TOKENIZER_VOCAB)
    config = read_json(os.path.join(TINY_CONFIGS, "tiny_demo_target.json"))
    config.update(vocab_size=-(-len(tokenizer) // 64) * 64,  # round up, as real models do
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=None)
    build_lm(path, AutoConfig.for_model(**config), tokenizer, texts, PRETRAIN.steps, seed)
    print0(f"built tiny target in {time.time() - t0:.0f}s: {path}")


# ----------------------------------------------------------------------------------------
# 21. golden traces: exact per-round records other implementations can be tested against
#
# One safetensors file. Its metadata key "eagle3_golden" holds a JSON header (format,
# version, run configuration, library versions); tensors are named "round0007.<field>".
# docs/reference.md documents every field.

GOLDEN_FORMAT, GOLDEN_VERSION = "eagle3-ref-golden", 1
GOLDEN_PROMPT = "Tell me a story about anna the cat."
FULL_SCORES_MAX_VOCAB = 4096   # logits / draft probabilities over larger vocabularies are
GOLDEN_TOP = 20                # stored as their top-20 values and ids plus a row checksum
SCORES_ATOL = 1e-4             # --check: logits and draft probabilities may differ by
                               # fp32 round-off; uniforms and integers must match exactly


def golden_rows(t, name, x):
    """(rows, V) scores in full for small vocabularies, else top-20 values, ids, checksum
    (integer tensors, e.g. a generator state, in full)."""
    if x.shape[-1] <= FULL_SCORES_MAX_VOCAB or not x.is_floating_point():
        t[name] = x
    else:
        top = x.topk(GOLDEN_TOP, dim=-1)
        t.update({name + "_top20_values": top.values, name + "_top20_ids": top.indices,
                  name + "_checksum": x.double().sum(-1)})


def sglang_tree(tree):
    """A Tree's linked lists as SGLang's build_tree_kernel_efficient returns them (-1: none):
    retrive_next_token[p] = p's first child, retrive_next_sibling[c] = c's next sibling.
    The rest of SGLang's tree is the Tree's own (positions offset, retrive_index b*N + node)."""
    N = len(tree.tokens)
    first, sibling = torch.full((N,), -1), torch.full((N,), -1)
    for parent, kids in enumerate(children_of(tree.parents)):
        if kids:
            first[parent] = kids[0]
            sibling[kids[:-1]] = torch.tensor(kids[1:], dtype=torch.long)
    return dict(retrive_next_token=first, retrive_next_sibling=sibling)


def golden_tensors(input_ids, result, preset=PRESETS["official"]):
    """One sequence's trace: prompt, output and per round the tree (also in the engine's
    layout), the target logits at its nodes, path, bonus and random numbers used."""
    t = dict(input_ids=input_ids[0].cpu(), tokens=result.tokens.cpu(),
             accept_lengths=torch.tensor(result.accept_lengths, dtype=torch.long),
             first_uniforms=torch.tensor(result.first_uniforms, dtype=torch.float64))
    for i, r in enumerate(result.rounds):
        p = f"round{i:04d}."
        t.update({p + "tree_tokens": r.tree.tokens, p + "parents": r.tree.parents,
                  p + "positions": r.tree.positions, p + "mask": r.tree.mask,
                  p + "retrieve_indices": r.tree.retrieve_indices, p + "path": r.path,
                  p + "accept_length": torch.tensor([r.accepted + 1]),
                  p + "bonus": torch.tensor([r.bonus]),
                  p + "uniforms": torch.tensor(r.uniforms, dtype=torch.float64)})
        golden_rows(t, p + "logits", r.logits)
        if r.draft_probs is not None:
            golden_rows(t, p + "draft_probs", r.draft_probs)
        if preset.verify is sglang_verify:        # SGLang's own tree tensors
            t.update({p + "sglang." + k: v for k, v in sglang_tree(r.tree).items()})
        for name, x in (r.draws or {}).items():    # the engine's random numbers (an Exp(1)
            golden_rows(t, p + name, x)            # vector over a large vocab as its top 20)
    return {k: v.contiguous() for k, v in t.items()}


def read_golden(path):
    from safetensors import safe_open
    try:
        f = safe_open(path, framework="pt")
        header = json.loads((f.metadata() or {}).get("eagle3_golden", "{}"))
    except Exception as e:  # not safetensors, truncated, or a broken header: not a trace
        fail(f"{path!r} is not a golden trace ({why(e)}); write one with `golden --out`")
    if header.get("format") != GOLDEN_FORMAT or header.get("version") != GOLDEN_VERSION:
        fail(f"{path!r} is not a golden trace of format {GOLDEN_FORMAT!r} version "
             f"{GOLDEN_VERSION} (found format={header.get('format')!r}, "
             f"version={header.get('version')!r}); regenerate it with this eagle3_ref.py")
    return header, {k: f.get_tensor(k) for k in f.keys()}


def golden_where(name):
    """'row01.round0003.path' -> 'row 1, round 3, field path'."""
    parts = []
    for what in ("row", "round"):
        if name.startswith(what):
            number, name = name[len(what):].split(".", 1)
            parts.append(f"{what} {int(number)}")
    return ", ".join(parts + [f"field {name}"])


def first_divergence(expected, actual):
    """The first field (in row and round order) where two traces differ, as a line, or
    None. Scores compare within SCORES_ATOL; everything else, coins included, exactly."""
    for name in sorted(set(expected) | set(actual)):
        where = golden_where(name)
        if name not in expected or name not in actual:
            return f"{where}: present only in the {'re-run' if name in actual else 'file'}"
        e, a = expected[name], actual[name]
        if e.shape != a.shape:
            return f"{where}: shape {tuple(e.shape)} in the file, {tuple(a.shape)} re-run"
        scores = e.is_floating_point() and ("logits" in name or "draft_probs" in name)
        bad = ((e.double() - a.double()).abs() > (SCORES_ATOL if scores else 0)).nonzero()
        if len(bad):
            index = tuple(bad[0].tolist())
            return (f"{where}, index {index if len(index) > 1 else index[0]}: "
                    f"file {e[index].item()}, re-run {a[index].item()}")
    return None


PRESET_NUMBERS = ("draft_pos_offset", "threshold_single", "threshold_acc")


def preset_record(preset):
    """A preset as a golden header records it: its name (fixing its functions), numbers."""
    return dict(name=preset.name, **{k: getattr(preset, k) for k in PRESET_NUMBERS})


def golden_run(cfg):
    """Run speculative decoding as described by a golden header -> (results, the trace's
    tensors: each sequence's as rowBB.<field>, plain names for one)."""
    record = cfg.get("preset", dict(name="official"))   # traces that name none: official
    preset = as_preset(record["name"])._replace(
        **{k: record[k] for k in PRESET_NUMBERS if k in record})
    target = load_target(cfg["target"], dtype=parse_dtype(cfg["dtype"]))
    if cfg.get("exact", False):   # traces written before the exact path ran without it
        make_exact(target)
    draft = load_draft(cfg["draft"], target, aux_convention=cfg.get("aux_convention"))
    rows = cfg["prompts"] if "prompts" in cfg else [cfg["input_ids"]]   # a batch, or one
    prompts = [torch.tensor([ids], device=target.lm_head.weight.device) for ids in rows]
    results = speculative_generate_batch(
        target, draft, prompts, cfg["max_new_tokens"], temperature=cfg["temperature"],
        top_p=cfg["top_p"], top_k=cfg["top_k"], tree=TreeShape(*cfg["tree"]), seed=cfg["seed"],
        eos_token_id=cfg["eos_token_id"], record_logits=True,
        variant=resolve_variant(preset, cfg["scheme"]))
    traces = [golden_tensors(ids, r, preset) for ids, r in zip(prompts, results)]
    if len(traces) == 1:
        return results, traces[0]
    return results, {f"row{b:02d}.{k}": v for b, t in enumerate(traces) for k, v in t.items()}


# ----------------------------------------------------------------------------------------
# 22. the main job: the whole method on a laptop CPU, nothing downloaded


class DecodeStats(NamedTuple):
    tau: float                # mean accept length (accepted drafts + 1) per round
    accept_rate_by_depth: list  # P(depth d accepted | depth d-1 accepted), d = 1..
    forwards_per_token: float  # target forward passes (prefill + rounds) per output token
    spec_tokens_per_s: float
    greedy_tokens_per_s: float
    lossless: bool
    spec_allreduce: tuple     # (calls, bytes) per output token, speculative (0 at W = 1)
    greedy_allreduce: tuple   # (calls, bytes) per output token, plain greedy


def best_time(run, repeats):
    """(result, fastest wall time) of `repeats` calls: the minimum filters out noise."""
    best, result = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - t0)
    return result, best


def greedy_with_comm(target, ids, max_new_tokens, eos):
    mark = target.tp.sent.copy()
    return greedy_generate(target, ids, max_new_tokens, eos), target.tp.sent.since(mark)


def measure_decoding(target, draft, prompts, max_new_tokens, tree=TreeShape(), eos=None, repeats=2):
    """Speculative vs plain greedy on the same prompts: speed, tau, exactness and the
    all-reduces each sends per token at this run's world size."""
    rounds, n_tokens, forwards, lossless, spec_comm, greedy_comm = [], 0, 0, True, [], []
    spec_s = greedy_s = 0.0
    speculative_generate(target, draft, prompts[0], 8, tree=tree)  # warm-up, untimed
    bar = Progress("decode: speculative and greedy", len(prompts))
    for ids in prompts:
        spec, seconds = best_time(lambda: speculative_generate(
            target, draft, ids, max_new_tokens, tree=tree, eos_token_id=eos), repeats)
        spec_s += seconds
        (plain, comm), seconds = best_time(lambda: greedy_with_comm(target, ids, max_new_tokens,
                                                                    eos), repeats)
        greedy_s += seconds
        lossless &= spec.tokens.tolist() == plain.tolist()
        rounds += spec.rounds
        n_tokens += len(spec.tokens)
        forwards += 1 + len(spec.rounds)
        spec_comm += [spec.prefill_comm] + [r.comm for r in spec.rounds]
        greedy_comm.append(comm)
        bar.show(len(greedy_comm))
    bar.done()
    accepted = torch.tensor([r.accepted for r in rounds])
    reached = [int((accepted >= d).sum()) for d in range(tree.depth + 2)]
    rate = [reached[d] / max(1, reached[d - 1]) for d in range(1, tree.depth + 2)]
    per_token = [(sum(t.calls["all_reduce"] for t in tallies) / n_tokens,  # (calls, bytes)
                  sum(t.bytes["all_reduce"] for t in tallies) / n_tokens)      # per token
                 for tallies in (spec_comm, greedy_comm)]
    return DecodeStats(float(accepted.float().mean() + 1), rate, forwards / n_tokens,
                       n_tokens / spec_s, n_tokens / greedy_s, lossless, *per_token)


class Demo(NamedTuple):
    train_prompts: int = 4000     # prompts whose target replies train the drafter
    eval_prompts: int = 64        # prompts whose replies give the held-out draft accuracy
    target_eval_texts: int = 200  # conversations for the target's own next-token accuracy
    decode_prompts: int = 24      # held-out prompts decoded at the end (speed, tau, exactness)
    reply_tokens: int = 64        # cap on each regenerated reply
    draft_vocab: int = 512        # Vd < the tiny target's vocab, so d2t/t2d are exercised
    max_new_tokens: int = 96
    seed: int = 0                 # pretraining corpus; each other corpus is seed + offset:
    train_offset: int = 1
    eval_offset: int = 2
    target_eval_offset: int = 3
    decode_offset: int = 4


DEMO = Demo()


def ensure_tiny_target():
    """Build the tiny target once (rank 0), reuse it afterwards -> (target dir, draft dir)."""
    target_dir, draft_dir = os.path.join(TINY_DIR, "target"), os.path.join(TINY_DIR, "draft")
    if is_rank0() and not os.path.isfile(os.path.join(target_dir, "config.json")):
        build_tiny_target(target_dir, DEMO.seed)
    if world_info()[1] > 1:
        dist.barrier()
    return target_dir, draft_dir


def demo_prompts(n, offset):
    """The prompts of n synthetic conversations from the corpus stream seed + offset."""
    return [p for p, _ in synthetic_corpus(n, DEMO.seed + offset)]


def replies_as_examples(target, tokenizer, prompts, max_new_tokens):
    """Chat-format the prompts, let the target answer, mark the reply tokens."""
    prompt_ids = [tokenizer(chat_text(p)).input_ids for p in prompts]
    replies = regenerate_replies(target, prompt_ids, max_new_tokens, tokenizer.eos_token_id)
    return [Example(p + r, [0] * len(p) + [1] * len(r)) for p, r in zip(prompt_ids, replies)]


def train_tiny_draft(target, tokenizer, out_dir):
    """Target replies -> vocab map -> TTT training -> the drafter's held-out accuracy."""
    def replies(n, offset):
        return replies_as_examples(target, tokenizer, demo_prompts(n, offset), DEMO.reply_tokens)
    train = replies(DEMO.train_prompts, DEMO.train_offset)
    held_out = replies(DEMO.eval_prompts, DEMO.eval_offset)
    counts = count_reply_tokens(train, target.cfg.vocab_size)
    vocab_map = build_vocab_mapping(counts, DEMO.draft_vocab)
    raw = dict(read_json(os.path.join(TINY_CONFIGS, "tiny_demo_draft.json")),
               vocab_size=target.cfg.vocab_size, draft_vocab_size=DEMO.draft_vocab)
    draft = fresh_draft(read_draft_config(raw, target.cfg), target, DEMO.seed, vocab_map)
    curve = train_draft(live_inputs(target, tokenizer.pad_token_id), draft, train, held_out,
                        TrainConfig(), out_dir)
    return draft, curve[-1]["step_accuracy"]


def ensure_tiny_models():
    """The tiny target and a drafter trained for it (built on first use)."""
    from transformers import AutoTokenizer
    target_dir, draft_dir = ensure_tiny_target()
    if not os.path.isfile(os.path.join(draft_dir, "config.json")):
        target = load_target(target_dir, dtype=torch.float32)
        train_tiny_draft(target, AutoTokenizer.from_pretrained(target_dir), draft_dir)
    return target_dir, draft_dir


def main_demo(exact=False):
    """The tiny end-to-end run: build/reuse the target, train the drafter, decode, report."""
    from transformers import AutoTokenizer
    t0 = time.time()
    target_dir, draft_dir = ensure_tiny_target()
    target = load_target(target_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    held_out_text = synthetic_corpus(DEMO.target_eval_texts, DEMO.seed + DEMO.target_eval_offset)
    target_acc = next_token_accuracy(target, [tokenizer(chat_text(p, r)).input_ids
                                              for p, r in held_out_text])
    print0(f"tiny target: {target.cfg.n_layers} layers, vocab {target.cfg.vocab_size}, "
           f"held-out top-1 next-token accuracy {target_acc:.3f}")
    draft, draft_acc = train_tiny_draft(target, tokenizer, draft_dir)
    if exact:
        make_exact(target)
    prompts = [torch.tensor([tokenizer(chat_text(p)).input_ids])
               for p in demo_prompts(DEMO.decode_prompts, DEMO.decode_offset)]
    stats = measure_decoding(target, draft, prompts, DEMO.max_new_tokens,
                             eos=tokenizer.eos_token_id)
    print0(f"speculative decoding on {len(prompts)} held-out prompts (tree {tuple(TreeShape())}):")
    print0(f"  tau (accepted + 1 per round)       {stats.tau:.2f}")
    rates = " ".join(f"{r:.2f}" for r in stats.accept_rate_by_depth)
    print0(f"  acceptance rate by depth           {rates}")
    print0(f"  target forwards per token          {stats.forwards_per_token:.3f} (greedy: 1.000)")
    print0(f"  tokens/s speculative / greedy      {stats.spec_tokens_per_s:.0f} / "
           f"{stats.greedy_tokens_per_s:.0f}")
    print0(f"  output equals greedy_generate      {stats.lossless}")
    print0(f"  draft accuracy per TTT step        {' '.join(f'{a:.3f}' for a in draft_acc)}")
    print0(json.dumps(dict(
        tau=round(stats.tau, 3), lossless=stats.lossless,
        speedup_vs_greedy=round(stats.spec_tokens_per_s / stats.greedy_tokens_per_s, 3),
        train_acc_step0=round(draft_acc[0], 3), draft_acc_per_step=[round(a, 3) for a in draft_acc],
        target_top1_acc=round(target_acc, 3), seconds=round(time.time() - t0, 1))))


# ----------------------------------------------------------------------------------------
# 23. command line: the main job, generate, golden, train


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "tiktoken.model", "vocab.json")


def load_tokenizer(path, args):
    """The tokenizer of a model dir (its own code, like Kimi's, only with --trust-remote-code)."""
    from transformers import AutoTokenizer
    trust = getattr(args, "trust_remote_code", False)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        fail(f"no tokenizer in {path!r} (none of {', '.join(TOKENIZER_FILES)}); point at the "
             f"model dir whose tokenizer this is")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            fail(f"the tokenizer in {path!r} ships its own code; rerun with "
                 f"--trust-remote-code if you trust it")
        fail(f"cannot load the tokenizer in {path!r}: {str(e).strip().splitlines()[0]}")


def encode_prompt(tokenizer, text, chat, device):
    ids = (chat_ids(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
           if chat else tokenizer(text).input_ids)
    return torch.tensor([ids], device=device)


def eos_ids(tokenizer, target_dir):
    """EOS ids from generation_config.json (Llama-3 lists several), else the tokenizer's."""
    path = os.path.join(target_dir, "generation_config.json")
    eos = read_json(path).get("eos_token_id") if os.path.isfile(path) else None
    return eos if eos is not None else tokenizer.eos_token_id


def model_dirs(args):
    """--target and --draft, or the tiny demo models (built on first use) without both."""
    if args.target is None:
        if args.draft:
            fail(f"--draft {args.draft!r} needs --target, the model it drafts for (without "
                 f"either, the tiny demo models are used)")
        return ensure_tiny_models()
    if args.draft is None:
        fail(f"--target {args.target!r} needs --draft, an EAGLE-3 drafter dir for it")
    return args.target, args.draft


def tree_shape(args):
    return TreeShape(top_k=args.tree_top_k, depth=args.depth, total_tokens=args.total_tokens)


def preset_of(args):
    """--preset, with the SGLang thresholds and draft RoPE offset when given."""
    preset = as_preset(args.preset)._replace(
        **{k: getattr(args, k) for k in PRESET_NUMBERS if getattr(args, k) is not None})
    if preset.threshold_single < 1 or preset.threshold_acc < 1:
        print(f"note: threshold_single={preset.threshold_single:g}, threshold_acc="
              f"{preset.threshold_acc:g} < 1 accept more drafts than p allows: the output is "
              f"no longer distributed as plain sampling (lossy)", file=sys.stderr)
    return preset


def render_tree(tree, path, tokenizer):
    """ASCII drawing of a draft tree; '*' marks the accepted path."""
    kids = children_of(tree.parents)
    on_path = set(path.tolist())

    def walk(node, prefix, last):
        mark = "*" if node in on_path else " "
        branch = "" if node == 0 else ("└─ " if last else "├─ ")
        yield f"{prefix}{branch}{mark}{tokenizer.decode([int(tree.tokens[node])])!r}"
        for i, child in enumerate(kids[node]):
            yield from walk(child, prefix + ("" if node == 0 else ("   " if last else "│  ")),
                            i == len(kids[node]) - 1)
    return "\n".join(walk(0, "", True))


def cmd_generate(args):
    if args.top_k and not args.temperature:
        fail("--top-k is the sampling top-k and needs --temperature > 0; "
             "the draft tree's top-k is --tree-top-k")
    preset = preset_of(args)
    target_dir, draft_dir = model_dirs(args)
    target = load_target(target_dir, dtype=parse_dtype(args.dtype))
    if args.exact:
        make_exact(target)
    draft = load_draft(draft_dir, target, aux_convention=args.aux_convention)
    tokenizer = load_tokenizer(target_dir, args)
    ids = encode_prompt(tokenizer, args.prompt, args.chat, target.lm_head.weight.device)
    t0 = time.perf_counter()
    result = speculative_generate(
        target, draft, ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, tree=tree_shape(args), seed=args.seed,
        eos_token_id=eos_ids(tokenizer, target_dir), variant=resolve_variant(preset, args.scheme))
    seconds = time.perf_counter() - t0
    if args.show_tree:
        for i, r in enumerate(result.rounds):
            print0(f"round {i + 1}: accepted {r.accepted}, bonus {tokenizer.decode([r.bonus])!r}")
            print0(render_tree(r.tree, r.path, tokenizer))
    print0(tokenizer.decode(result.tokens))
    rounds = max(1, len(result.rounds))
    tau = sum(result.accept_lengths) / rounds   # mean(accepted + 1), as official and vLLM
    engine = (f" | {preset.name} reports {(len(result.tokens) - 1) / rounds:.2f}"
              if preset.tau_emitted else "")    # SGLang: the tokens each round emitted
    print0(f"tau {tau:.2f}{engine} | rounds {len(result.rounds)} | tokens {len(result.tokens)} | "
           f"{len(result.tokens) / seconds:.1f} tokens/s")


def parse_numbers(text, kind, what, count=None):
    """'1.5,2,3' -> numbers, or a one-line error naming the flag and the bad item."""
    items = text.split(",")
    for x in items:
        try:
            kind(x)
        except ValueError:
            fail(f"{what} {text!r}: {x.strip()!r} is not {'an' if kind is int else 'a'} "
                 f"{kind.__name__}; expected "
                 f"{count or 'a list of'} comma-separated {kind.__name__} values")
    if count and len(items) != count:
        fail(f"{what} {text!r} must be {count} comma-separated {kind.__name__} values")
    return [kind(x) for x in items]


def golden_config(args):
    """The run a new golden trace records (the header's `config`)."""
    prompts = ([parse_numbers(row, int, "--prompt-ids") for row in args.prompt_ids.split(";")]
               if args.prompt_ids else None)
    target_dir, draft_dir = model_dirs(args)
    if prompts is None:
        tokenizer = load_tokenizer(target_dir, args)
        prompts = [encode_prompt(tokenizer, text, True, "cpu")[0].tolist()
                   for text in args.prompt or [GOLDEN_PROMPT]]
    batch = dict(input_ids=prompts[0]) if len(prompts) == 1 else dict(prompts=prompts)
    return dict(target=os.path.abspath(target_dir), draft=os.path.abspath(draft_dir), **batch,
                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, tree=list(tree_shape(args)),
                scheme=args.scheme, seed=args.seed, dtype=args.dtype or "float32",
                eos_token_id=args.eos_token_id, aux_convention=args.aux_convention,
                preset=preset_record(preset_of(args)), exact=args.exact)


def cmd_golden(args):
    import transformers
    from safetensors.torch import save_file
    if args.check:
        header, expected = read_golden(args.check)
        cfg = dict(header["config"], **{k: v for k, v in (("target", args.target),
                                                          ("draft", args.draft)) if v})
        diff = first_divergence(expected, golden_run(cfg)[1])
        print0("match" if diff is None else f"first divergence: {diff}")
        return 0 if diff is None else 1
    if not args.out:
        fail("golden needs --out FILE (write a trace) or --check FILE (re-run and compare)")
    cfg = golden_config(args)
    results, tensors = golden_run(cfg)
    header = dict(config=cfg, world_size=world_info()[1], torch=torch.__version__,
                  transformers=transformers.__version__, format=GOLDEN_FORMAT,
                  version=GOLDEN_VERSION)
    if is_rank0():
        atomic_write(args.out, lambda f: save_file(tensors, f, metadata={
            "eagle3_golden": json.dumps(header)}))
    rounds, tokens = sum(len(r.rounds) for r in results), sum(len(r.tokens) for r in results)
    print0(f"wrote {args.out}: {rounds} rounds, {tokens} tokens"
           + (f" ({len(results)} sequences)" if len(results) > 1 else ""))


def pad_id_of(path, args):
    """The pad id a model dir's tokenizer uses (0 without one): only padded positions see it."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return 0
    pad = load_tokenizer(path, args).pad_token_id
    return pad if pad is not None else 0


def check_examples(examples, where, max_len):
    if len(examples) < 2:
        fail(f"{where} gives {len(examples)} usable conversations (with an assistant turn, at "
             f"most --max-len {max_len} tokens); need at least 2")


def train_command(args, target, inputs, examples):
    """train, once data and target are read: hold out 1/50, map the vocab (or keep
    --init-draft's), run TTT, print the last curve point."""
    train, held_out = held_out_split(examples)
    if args.init_draft:
        draft = load_draft(args.init_draft, target, dtype=torch.float32,
                           aux_convention=args.aux_convention)
    else:
        vocab_map = build_vocab_mapping(count_reply_tokens(train, target.cfg.vocab_size),
                                        args.draft_vocab_size)
        draft = fresh_draft(draft_config_for(target, args.draft_vocab_size), target, args.seed,
                            vocab_map, dtype=torch.float32)
    steps = args.steps or max(1, args.epochs * len(train) // args.batch)
    every = args.eval_every or max(1, steps // 10)
    cfg = TrainConfig(steps=steps, batch=args.batch, lr=args.lr, warmup=max(1, steps // 50),
                      ttt_steps=args.ttt_steps, eval_every=every, save_every=every, seed=args.seed,
                      bf16=args.autocast == "bf16", save_for=args.engine)
    curve = train_draft(inputs, draft, train, held_out, cfg, args.out, args.resume)
    print0(json.dumps(dict(last=curve[-1], steps=steps)))


def cmd_train(args):
    if not args.data:
        fail("train needs --data FILE.jsonl: chat conversations whose replies it learns")
    examples = training_examples(load_tokenizer(args.target, args), args.data, args.max_len)
    check_examples(examples, args.data, args.max_len)   # the data first: it is cheap
    target = load_target(args.target, dtype=parse_dtype(args.dtype))
    train_command(args, target, live_inputs(target, pad_id_of(args.target, args)), examples)


AUX_CONVENTION_FLAG = dict(choices=AUX_CONVENTIONS, help="how to read the drafter's aux-layer "
                           "ids (docs/reference.md: Conventions); default: the convention its "
                           "config names, else specforge")
SAVE_FOR_FLAG = dict(dest="engine", default="specforge", choices=AUX_CONVENTIONS,
                     help="the engine whose convention the saved drafter's aux ids are in "
                          "(only non-default aux layers are written; default specforge)")


# --exact (make_exact) is opt-in: in fp32 the plain path already keeps greedy speculation
# equal to greedy decoding (and fp32 goldens stay as they were); in bf16 / fp16 make_exact
# does (on a GPU run the probe first), at one attention call per verify row and layer.
EXACT_FLAG = dict(action="store_true", help="serve the target on the exact path (make_exact): "
                  "greedy speculation equals greedy decoding in bf16 / fp16 too")


def remote_code_flag():
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--trust-remote-code", action="store_true",
                        help="run a tokenizer's own code (e.g. Kimi's tiktoken tokenizer)")
    return remote


def flag_groups():
    """Parent parsers for the flags that generate, golden and bench share."""
    models = argparse.ArgumentParser(add_help=False, parents=[remote_code_flag()])
    models.add_argument("--target", help="Hugging Face model dir (default: the tiny demo target)")
    models.add_argument("--draft", help="EAGLE-3 drafter dir, official or SpecForge layout "
                                        "(default: the tiny demo drafter)")
    models.add_argument("--dtype", help="float32 | bfloat16 | float16 "
                                        "(default: fp32 on CPU, bf16 on CUDA)")
    models.add_argument("--exact", **EXACT_FLAG)   # golden: recorded in the trace's header
    tree = argparse.ArgumentParser(add_help=False)
    tree.add_argument("--tree-top-k", type=int, default=TOP_K, help="the draft tree's top-k")
    tree.add_argument("--depth", type=int, default=DEPTH,
                      help="expansion passes: the deepest draft is depth + 1 below the root")
    tree.add_argument("--total-tokens", type=int, default=TOTAL_TOKENS)
    models.add_argument("--aux-convention", **AUX_CONVENTION_FLAG)
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
    sampling.add_argument("--seed", type=int, default=0)
    sampling.add_argument("--scheme", default="tree", choices=SCHEMES,
                          help="tree: the official dynamic tree; chain: a sampled chain")
    sampling.add_argument("--preset", default="official", choices=list(PRESETS),
                          help="whose conventions: tree scores, verification, random numbers, "
                               "warper order (docs/reference.md: the difference table)")
    sampling.add_argument("--threshold-single", type=float,
                          help="sglang: accept a child with p >= this (default 1: lossless)")
    sampling.add_argument("--threshold-acc", type=float,
                          help="sglang: accept when coin <= sum p / this (default 1: lossless)")
    sampling.add_argument("--draft-pos-offset", type=int, choices=(0, 1),
                          help="1: draft the tree's levels one RoPE position late, as SGLang "
                               "before sgl-project/sglang#25015")
    return models, tree, sampling


POSITIVE_FLAGS = ("max_new_tokens", "batch", "epochs", "steps", "eval_every", "lr", "ttt_steps",
                  "max_len", "draft_vocab_size", "tree_top_k", "depth", "total_tokens")
PATH_FLAGS = dict(  # flag -> what must be there: "dir", "file" or "any" (a dir or a file)
    target="dir", draft="dir", init_draft="dir", data="file", check="file")
FILE_OUTPUTS = ("golden",)  # commands whose --out is one file; others a dir


def check_args(args, path_flags=PATH_FLAGS, file_outputs=FILE_OUTPUTS, positive=POSITIVE_FLAGS):
    """Every path a command reads exists, is of its kind and readable, the counts, sizes and
    rates it takes are > 0, and --out can be written: checked before anything loads, so a
    typo is one line naming the flag."""
    for name, kind in path_flags.items():
        path, flag = getattr(args, name, None), "--" + name.replace("_", "-")
        if path is None:
            continue
        if not os.path.exists(path):
            what = dict(dir="directory", file="file", any="file or directory")[kind]
            fail(f"{flag} {path!r} does not exist; expected a local {what}")
        if kind == "dir" and not os.path.isdir(path):
            fail(f"{flag} {path!r} is a file; expected a directory (the one holding it?)")
        if kind == "file" and not os.path.isfile(path):
            fail(f"{flag} {path!r} is a directory; expected a file")
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            fail(f"{flag} {path!r} is not readable: check its permissions")
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            fail(f"--{name.replace('_', '-')} {value} must be > 0")
    out = getattr(args, "out", None)
    if out is None:
        return
    is_file = args.command in file_outputs   # else a dir, created with its missing parents
    if is_file and os.path.isdir(out):
        fail(f"--out {out!r} is a directory; expected the path of the file to write")
    if not is_file and os.path.exists(out) and not os.path.isdir(out):
        fail(f"--out {out!r} is a file; expected a directory to write into")
    parent = os.path.dirname(os.path.abspath(out))
    if is_file and not os.path.isdir(parent):
        fail(f"--out {out!r}: its directory {parent!r} does not exist; create it first")
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        fail(f"--out {out!r} cannot be written: {parent!r} is not a writable directory")


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line like every other error (usage: --help)."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(*extensions, description="EAGLE-3 reference: with no command, run the tiny "
                 "end-to-end demo (train a drafter, decode, report).", default=None):
    """The reference's parser; each extension(sub, train) may add commands, or flags to train."""
    p = Parser(description=description)
    sub = p.add_subparsers(dest="command")
    shared = list(flag_groups())   # models, tree, sampling
    g = sub.add_parser("generate", parents=shared,
                       help="speculative decoding: a target and an EAGLE-3 drafter")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--show-tree", action="store_true", help="draw each round's tree")
    g.set_defaults(run=cmd_generate)
    gd = sub.add_parser("golden", parents=shared,
                        help="write (--out) or re-check (--check) a golden trace")
    gd.add_argument("--out")
    gd.add_argument("--check")
    gd.add_argument("--prompt", action="append",
                    help=f"chat prompt text (repeat for a batch; default {GOLDEN_PROMPT!r})")
    gd.add_argument("--prompt-ids", help="token ids instead of --prompt: 1,2,3 (one "
                                         "sequence) or 1,2,3;4,5 (a batch)")
    gd.add_argument("--max-new-tokens", type=int, default=64)
    gd.add_argument("--eos-token-id", type=int)
    gd.set_defaults(run=cmd_golden)
    t = sub.add_parser("train", parents=[remote_code_flag()],
                       help="train an EAGLE-3 drafter for a target on chat data")
    t.add_argument("--target", required=True, help="Hugging Face model dir")
    t.add_argument("--data", help="JSONL: ShareGPT conversations or messages")
    t.add_argument("--out", required=True, help="drafter dir (checkpoints, train_state.pt)")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--steps", type=int, help="optimizer steps instead of --epochs: the learning "
                   "rate anneals over them, so a short budget still ends annealed")
    t.add_argument("--eval-every", type=int, help="steps between held-out evaluations "
                   "(default steps/10)")
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--draft-vocab-size", type=int, default=32000)
    t.add_argument("--max-len", type=int, default=2048, help="longer conversations are dropped")
    t.add_argument("--ttt-steps", type=int, default=TTT_STEPS)
    t.add_argument("--init-draft", help="start from this drafter (keeps its vocab map)")
    t.add_argument("--aux-convention", **AUX_CONVENTION_FLAG)
    t.add_argument("--for", **SAVE_FOR_FLAG)
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", help="the target's weights (default: fp32 on a CPU)")
    t.add_argument("--autocast", choices=("none", "bf16"), default="none",
                   help="bf16: the forward's matmuls in bf16, the drafter's weights in fp32")
    t.set_defaults(run=cmd_train)
    for extend in extensions:
        extend(sub, t)
    if default is None:   # the main job is this parser's own
        p.add_argument("--exact", **EXACT_FLAG)
    p.set_defaults(run=default or (lambda args: main_demo(args.exact)))
    return p


def main(argv=None, parser=None, check=check_args):
    import transformers
    transformers.logging.set_verbosity_error()   # keep the report readable
    transformers.utils.logging.disable_progress_bar()
    args = (parser or build_parser()).parse_args(argv)
    try:
        check(args)
        init_distributed()
        code = args.run(args) or 0
    except Eagle3Error as e:  # wrong input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if dist.is_available() and dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
        # torch 2.13 + gloo can abort a rank during interpreter teardown after autograd and
        # collectives ("terminate called without an active exception"), turning a finished
        # run into a failed one; everything is written, so leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
