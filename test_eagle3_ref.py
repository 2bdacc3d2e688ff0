"""The eagle3-ref test suite: each property of SPEC.md, checked against an independent
computation -- transformers' own model, a brute-force enumeration, or a tree worked out by
hand in the test -- never against the function's own output.

    python -m pytest -q test_eagle3_ref.py

Every model is a tiny random one built here (no downloads). The tensor-parallel tests run
this same file as the torchrun worker:

    python -m torch.distributed.run --standalone --nproc_per_node=2 test_eagle3_ref.py tp JOB OUT
"""
import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import eagle3_ref as E

torch.set_num_threads(1)  # tiny models run fastest on one thread; torchrun workers get a core each
transformers.logging.set_verbosity_error()

VOCAB = 24       # small target vocab: greedy text varies and random drafters hit (SPEC §9)
LAYERS = 8       # aux layers (2, L//2, L-3) = (2, 4, 5)
HIDDEN = 64
MAX_POS = 512    # the KV cache length limit of every tiny target
ATOL = 1e-4      # fp32 round-off between two implementations of the same network (logits)
RTOL = 1e-5      # residual-stream features reach |x| ~ 60: round-off grows with their scale


def assert_close(actual, expected, what=""):
    """Equal up to fp32 round-off: max abs diff <= ATOL + RTOL * max |expected|."""
    diff, scale = float((actual - expected).abs().max()), float(expected.abs().max())
    assert diff <= ATOL + RTOL * scale, f"{what} max abs diff {diff:.3g} at scale {scale:.3g}"


TARGETS = {  # test name -> (model_type, config overrides)
    "llama": ("llama", {}),                                  # GQA: 4 query heads, 2 kv heads
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", {}),                                  # q/k/v biases
    "qwen3": ("qwen3", dict(head_dim=24)),                   # q/k norms, head_dim != 64 / 4
    "llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "yarn": ("llama", dict(rope_parameters=dict(                 # also scales cos/sin
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128))),
    "tied": ("llama", dict(tie_word_embeddings=True)),
}


# ----------------------------------------------------------------------------------------
# tiny random models


def random_hf_model(name, seed=0, layers=LAYERS, std=0.25):
    """A transformers model with every weight ~ N(0, std) (norm gains ~ 1 + N(0, std)):
    std 0.25 over a 24-token vocab gives varied greedy text (SPEC §9)."""
    family, overrides = TARGETS[name]
    config = AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POS, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            torch.nn.init.normal_(p, std=std)
            if "norm" in pname:
                p.add_(1.0)
    return model.eval()


class Zoo:
    """Random tiny checkpoints, each built, saved and loaded once per module (on first use;
    the seed depends on the name only, so any subset of tests sees the same models)."""

    def __init__(self, root):
        self.root, self.models, self.targets = root, {}, {}

    def hf(self, name):
        if name not in self.models:
            self.models[name] = random_hf_model(name, seed=list(TARGETS).index(name))
            self.models[name].save_pretrained(self.root / name)
        return self.models[name]

    def dir(self, name):
        self.hf(name)
        return str(self.root / name)

    def target(self, name):
        if name not in self.targets:
            self.hf(name)
            self.targets[name] = E.load_target(self.dir(name))
        return self.targets[name]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("targets"))


def random_prompt(seed, length=12):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def hf_forward(model, ids):
    """transformers' logits (T, V) and hidden states (tuple of (T, D)) for one sequence."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def hf_aux(hidden_states, layers):
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def hf_greedy(model, ids, max_new_tokens):
    """transformers' greedy decoding; the mask keeps prompt tokens equal to pad visible."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1]:]


def draft_config_dict(draft_vocab_size=None, **extra):
    """A SpecForge-layout drafter config.json for the tiny targets."""
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=HIDDEN,
               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-6, max_position_embeddings=MAX_POS, rope_theta=10000.0,
               vocab_size=VOCAB, tie_word_embeddings=False)
    if draft_vocab_size is not None:
        raw["draft_vocab_size"] = draft_vocab_size
    return dict(raw, **extra)


def random_draft(target, seed, kept=None, std=0.1, **extra):
    """A randomly initialised drafter; `kept` (ascending target ids) is its draft vocab, with
    d2t/t2d filled by hand: draft id i <-> target id kept[i]."""
    raw = draft_config_dict(None if kept is None else len(kept), **extra)
    draft = E.init_draft(E.new_draft(E.read_draft_config(raw, target.cfg), target), seed, std=std)
    if kept is not None:
        draft.d2t.copy_(kept - torch.arange(len(kept)))
        draft.t2d.zero_()
        draft.t2d[kept] = True
    return draft


def sharpen(draft, target, sequences, kept=None, steps=60, unroll=3, lr=1e-2):
    """Teach a random drafter the target's greedy choices on `sequences` with a few Adam
    steps of a simplified training-time test, so its drafts are accepted several levels
    deep. Step k: draft position p holds token p+1+k and predicts the target's choice for
    token p+2+k; tokens outside the draft vocab are not trained on."""
    with torch.no_grad():
        logits, aux = target(sequences)
    labels = logits.argmax(-1)                               # (B, T) target's next token
    if kept is not None:
        to_draft = torch.full((VOCAB,), -100)
        to_draft[kept] = torch.arange(len(kept))
        labels = to_draft[labels]
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    T = sequences.shape[1] - 1
    for _ in range(steps):
        h, loss = draft.fc(aux[:, :-1]), 0.0
        for k in range(unroll):
            n = T - k
            h = draft(h[:, :n], sequences[:, 1 + k:1 + k + n], torch.arange(k, k + n),
                      E.causal_mask(n, 0, h.device))
            loss = loss + F.cross_entropy(draft.logits(h).flatten(0, 1),
                                          labels[:, 1 + k:1 + k + n].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.requires_grad_(False)
    return draft


def path_to(parents, node):
    """Root-to-node list of node indices, by walking parents."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


# ----------------------------------------------------------------------------------------
# target model: logits and aux features equal transformers'


@pytest.mark.parametrize("name", list(TARGETS))
def test_target_logits_equal_transformers(zoo, name):
    ids = random_prompt(1, length=40)
    ref_logits, _ = hf_forward(zoo.hf(name), ids)
    logits, _ = zoo.target(name)(ids)
    assert logits.shape == (1, 40, VOCAB)
    assert (logits[0] - ref_logits).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(TARGETS))
def test_aux_features_are_residuals_entering_layers_2_mid_and_L_minus_3(zoo, name):
    ids = random_prompt(2, length=20)
    _, hidden_states = hf_forward(zoo.hf(name), ids)
    _, aux = zoo.target(name)(ids)
    L = LAYERS
    expected = torch.cat([hidden_states[2], hidden_states[L // 2], hidden_states[L - 3]], dim=-1)
    assert aux.shape == (1, 20, 3 * HIDDEN)
    assert_close(aux[0], expected)


def test_sharded_safetensors_checkpoint_loads_like_transformers(zoo, tmp_path):
    model = zoo.hf("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ids = random_prompt(3, length=16)
    ref_logits, _ = hf_forward(model, ids)
    logits, _ = E.load_target(str(tmp_path))(ids)
    assert (logits[0] - ref_logits).abs().max() <= ATOL


def test_pytorch_model_bin_checkpoint_loads_like_transformers(zoo, tmp_path):
    # transformers 5 always writes safetensors, so write the .bin as older checkpoints have it
    model = zoo.hf("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    ids = random_prompt(4, length=16)
    ref_logits, _ = hf_forward(model, ids)
    logits, _ = E.load_target(str(tmp_path))(ids)
    assert (logits[0] - ref_logits).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(TARGETS))
def test_greedy_generate_equals_transformers_generate(zoo, name):
    ids = random_prompt(5)
    expected = hf_greedy(zoo.hf(name), ids, 40)
    assert len(set(expected[10:].tolist())) >= 3, "degenerate test model: constant text"
    assert E.greedy_generate(zoo.target(name), ids, 40).tolist() == expected.tolist()


# ----------------------------------------------------------------------------------------
# tree verification over a KV cache, and commit


def random_tree(seed, n_nodes=12):
    """Random tokens and random parents (each parent precedes its child)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n_nodes)]
    tokens = torch.randint(0, VOCAB, (n_nodes,), generator=g)
    return tokens, parents


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_verify_tree_gives_each_node_the_logits_and_features_of_its_path(zoo, name):
    hf, target = zoo.hf(name), zoo.target(name)
    prefix = random_prompt(6, length=10)
    tokens, parents = random_tree(7)
    assert max(len(path_to(parents, i)) for i in range(len(parents))) >= 4, "tree too shallow"
    cache = target.new_cache(64)
    target(prefix, cache=cache)
    tree = E.tree_from_parents(tokens, torch.tensor(parents))
    logits, aux = E.verify_tree(target, cache, 10, tree, target.cfg.default_aux_layers)
    for node in range(len(tokens)):
        ids = torch.cat([prefix[0], tokens[path_to(parents, node)]])[None]
        ref_logits, hidden_states = hf_forward(hf, ids)
        assert (logits[node] - ref_logits[-1]).abs().max() <= ATOL, f"node {node}"
        assert_close(aux[node], hf_aux(hidden_states, (2, 4, 5))[-1], f"node {node}")


def test_commit_then_decode_equals_recompute_from_scratch(zoo):
    hf, target = zoo.hf("llama"), zoo.target("llama")
    prefix = random_prompt(8, length=10)
    tokens, parents = random_tree(9)
    cache = target.new_cache(64)
    target(prefix, cache=cache)
    E.verify_tree(target, cache, 10, E.tree_from_parents(tokens, torch.tensor(parents)), (2, 4, 5))
    path = max((path_to(parents, i) for i in range(len(parents))), key=len)  # deepest node
    assert path != list(range(len(path))), "path must need a gather, not be the first nodes"
    n = E.commit(cache, 10, torch.tensor(path))
    assert n == 10 + len(path)
    seq = torch.cat([prefix[0], tokens[path]])
    for step, token in enumerate([3, 17, 11]):  # decode three more tokens on the cache
        seq = torch.cat([seq, torch.tensor([token])])
        logits, _ = target(torch.tensor([[token]]), cache=cache, start=n + step)
        ref_logits, _ = hf_forward(hf, seq[None])
        assert (logits[0, -1] - ref_logits[-1]).abs().max() <= ATOL, f"step {step}"


# ----------------------------------------------------------------------------------------
# bad input to the target and to generation: one clear Eagle3Error


def test_unknown_model_type_is_refused_listing_supported_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt2", vocab_size=VOCAB)))
    supported = r"model_type='gpt2'.*supported: llama, mistral, qwen2, qwen3"
    with pytest.raises(E.Eagle3Error, match=supported):
        E.load_target(str(tmp_path))


def test_heads_not_divisible_by_world_size_are_refused(zoo):
    cfg = E.read_target_config(zoo.dir("llama"))  # 4 query heads, 2 kv heads
    with pytest.raises(E.Eagle3Error, match=r"num_attention_heads=4 and num_key_value_heads=2 "
                                            r"must both be divisible by the world size 3"):
        E.Target(cfg, world=3)


def edited_checkpoint(zoo, tmp_path, edit):
    """A copy of the tiny llama checkpoint whose weights went through `edit(state)`."""
    shutil.copytree(zoo.dir("llama"), tmp_path, dirs_exist_ok=True)
    state = load_file(tmp_path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    return str(tmp_path)


def test_missing_weight_key_is_refused_naming_it(zoo, tmp_path):
    path = edited_checkpoint(zoo, tmp_path, lambda s: s.pop("model.layers.3.mlp.up_proj.weight"))
    message = r"missing keys \['model\.layers\.3\.mlp\.up_proj\.weight'\]"
    with pytest.raises(E.Eagle3Error, match=message):
        E.load_target(path)


def test_unexpected_weight_key_is_refused_naming_it(zoo, tmp_path):
    path = edited_checkpoint(zoo, tmp_path, lambda s: s.update(
        {"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    message = r"unexpected keys \['model\.layers\.0\.mlp\.extra\.weight'\]"
    with pytest.raises(E.Eagle3Error, match=message):
        E.load_target(path)


def test_corrupt_safetensors_file_is_refused(zoo, tmp_path):
    shutil.copytree(zoo.dir("llama"), tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(E.Eagle3Error, match=r"model\.safetensors.*corrupt"):
        E.load_target(str(tmp_path))


def official_draft_dir(path, target, draft_vocab_size=20):
    """An official-layout drafter dir, as released for LLaMA-3.1-8B: architectures
    LlamaForCausalLM, no rope_theta, pytorch_model.bin without the frozen embedding.
    Returns the state dict written."""
    os.makedirs(path, exist_ok=True)
    kept = torch.arange(draft_vocab_size)
    draft = random_draft(target, seed=5, kept=kept, std=0.2)
    state = {k: v.clone() for k, v in draft.state_dict().items()
             if not k.startswith("embed_tokens")}
    torch.save(state, os.path.join(path, "pytorch_model.bin"))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
                  intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  hidden_act="silu", initializer_range=0.02, pad_token_id=0,
                  tie_word_embeddings=False, torch_dtype="float16", use_cache=True,
                  vocab_size=VOCAB, draft_vocab_size=draft_vocab_size)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return state


def test_fewer_than_7_layers_is_refused_when_aux_features_are_needed(tmp_path, zoo):
    with pytest.raises(E.Eagle3Error, match=r"num_hidden_layers >= 7"):
        E.check_aux_layers((2, 3, 3), 6)          # (2, L//2, L-3) for L = 6 collide
    six = random_hf_model("llama", layers=6)
    six.save_pretrained(tmp_path / "target")
    official_draft_dir(str(tmp_path / "draft"), zoo.target("llama"))
    with pytest.raises(E.Eagle3Error, match=r"aux layers \(2, 3, 3\) for a 6-layer target"):
        E.load_draft(str(tmp_path / "draft"), E.load_target(str(tmp_path / "target")))


GENERATORS = {  # the two generation entry points must check their inputs alike
    "greedy": lambda target, draft, ids, n: E.greedy_generate(target, ids, n),
    "speculative": lambda target, draft, ids, n: E.speculative_generate(
        target, draft, ids, n, tree=E.TreeShape(2, 2, 6)),
}


@pytest.fixture(scope="module")
def plain_draft(zoo):
    return random_draft(zoo.target("llama"), seed=3)


@pytest.mark.parametrize("generate", list(GENERATORS))
def test_empty_prompt_is_refused(zoo, plain_draft, generate):
    with pytest.raises(E.Eagle3Error, match=r"prompt is empty"):
        GENERATORS[generate](zoo.target("llama"), plain_draft,
                             torch.zeros(1, 0, dtype=torch.long), 5)


@pytest.mark.parametrize("generate", list(GENERATORS))
def test_prompt_plus_new_tokens_over_cache_length_is_refused(zoo, plain_draft, generate):
    # a 12-token prompt + 501 new tokens > max_position_embeddings = 512
    with pytest.raises(E.Eagle3Error, match=r"exceeds the cache length 512"):
        GENERATORS[generate](zoo.target("llama"), plain_draft, random_prompt(0), 501)


@pytest.mark.parametrize("generate", list(GENERATORS))
@pytest.mark.parametrize("max_new_tokens", [0, -3])
def test_non_positive_max_new_tokens_is_refused(zoo, plain_draft, generate, max_new_tokens):
    with pytest.raises(E.Eagle3Error, match=rf"max_new_tokens={max_new_tokens} must be a positive"):
        GENERATORS[generate](zoo.target("llama"), plain_draft, random_prompt(0), max_new_tokens)


def test_unbuildable_tree_shape_is_refused(zoo, plain_draft):
    # top_k=2, depth=1: a pool of 2 + 1*4 = 6 candidates, so at most 7 nodes with the root
    with pytest.raises(E.Eagle3Error, match=r"total_tokens=8 cannot be built.*= 7 nodes"):
        E.speculative_generate(zoo.target("llama"), plain_draft, random_prompt(0), 5,
                               tree=E.TreeShape(2, 1, 8))


# ----------------------------------------------------------------------------------------
# the draft tree: a hand-worked example with a scripted drafter


class MarkovDrafter:
    """A scripted drafter: next-token log-probabilities depend only on the last token
    (a table written out in the test). Its hidden state is the one-hot last token, so
    logits(h) reads that token's row. It records what each draft pass was given."""

    def __init__(self, probs):
        self.table = torch.tensor(probs).log()                       # (V, V) log-probs
        V = self.table.shape[0]
        self.cfg = SimpleNamespace(aux_layers=(2, 4, 5), vocab_size=V, draft_vocab_size=V)
        self.calls = []

    def fc(self, aux):
        return aux.new_zeros(*aux.shape[:-1], self.cfg.vocab_size)

    def __call__(self, h, tokens, positions, mask, cache=None, start=0):
        self.calls.append(dict(tokens=tokens.tolist(), positions=positions.tolist(),
                               mask=mask.int().tolist(), start=start))
        return F.one_hot(tokens, self.cfg.vocab_size).to(h.dtype)

    def logits(self, h):
        return h @ self.table

    def to_target_ids(self, draft_ids):
        return draft_ids

    def new_cache(self, length):
        return None


def markov_rows(top, V=6):
    """Probability rows: the listed tokens get their probabilities, the rest share what is left."""
    rows = []
    for last in range(V):
        rest = [t for t in range(V) if t not in top[last]]
        left = (1 - sum(top[last].values())) / len(rest)
        rows.append([top[last].get(t, left) for t in range(V)])
    return rows


# P(next | last) for the hand-worked tree; the two most likely next tokens of each row:
HAND_TABLE = markov_rows({0: {1: .6, 2: .25}, 1: {3: .7, 4: .2}, 2: {5: .5, 3: .3},
                          3: {2: .9, 1: .05}, 4: {0: .4, 1: .3}, 5: {0: .55, 4: .4}})
HAND_INPUT = torch.tensor([[5, 4, 3, 0]])   # three featured tokens, then the root 0


def test_draft_tree_matches_hand_worked_example():
    # top_k=2, depth=2, total_tokens=5; scores are cumulative probabilities (log-probs summed):
    #   level 1, children of root 0:  pool 0 = token 1 (.6)   pool 1 = token 2 (.25)
    #   expand pool 0 (token 1, .6):  pool 2 = token 3 (.42)  pool 3 = token 4 (.12)
    #   expand pool 1 (token 2, .25): pool 4 = token 5 (.125) pool 5 = token 3 (.075)
    #   rerank: best two of {.42, .12, .125, .075} = pool 2 (.42), pool 4 (.125)
    #   expand pool 2 (token 3, .42): pool 6 = token 2 (.378) pool 7 = token 1 (.021)
    #   expand pool 4 (token 5, .125):pool 8 = token 0 (.06875) pool 9 = token 4 (.05)
    #   best 4 of the 10: .6 (0), .42 (2), .378 (6), .25 (1) -> by flat index [0, 1, 2, 6]
    #   nodes 1..4 = pool 0, 1, 2, 6; parents: root, root, pool 0 = node 1, pool 2 = node 3
    aux = torch.zeros(1, 3, 3 * HIDDEN)
    tree = E.draft_tree(MarkovDrafter(HAND_TABLE), aux, HAND_INPUT, 2, 2, 5)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.positions.tolist() == [0, 1, 1, 2, 3]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [1, 0, 1, 0, 0],
                                        [1, 1, 0, 1, 0],
                                        [1, 1, 0, 1, 1]]
    assert tree.retrieve_indices.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]  # leaves 2 and 4


def test_tree_drafting_feeds_each_level_at_one_position_seeing_prefix_and_ancestors():
    # Same example. The prefix pass feeds pairs (feature of token p, token p+1) at positions
    # 0..2; level 1 (tokens 1, 2) sits at position 3 in draft slots 3-4, level 2 (tokens 3, 5:
    # children of slot 3 and slot 4) at position 4 in slots 5-6. Each row sees the 3 prefix
    # slots, its ancestors and itself.
    drafter = MarkovDrafter(HAND_TABLE)
    E.draft_tree(drafter, torch.zeros(1, 3, 3 * HIDDEN), HAND_INPUT, 2, 2, 5)
    assert drafter.calls == [
        dict(tokens=[[4, 3, 0]], positions=[0, 1, 2], start=0,
             mask=[[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        dict(tokens=[[1, 2]], positions=[3, 3], start=3,
             mask=[[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]),
        dict(tokens=[[3, 5]], positions=[4, 4], start=5,
             mask=[[1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0, 1]]),
    ]


# ----------------------------------------------------------------------------------------
# the draft tree: invariants over many random drafters


def test_draft_tree_invariants_hold_for_random_drafters(zoo):
    target = zoo.target("llama")
    kept = torch.tensor([0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 14, 15, 17, 19, 20, 23])  # 16 of 24
    drafters = [random_draft(target, seed=s, kept=kept if s % 2 else None, std=0.3)
                for s in range(4)]
    g = torch.Generator().manual_seed(11)
    for case in range(40):
        draft = drafters[case % 4]
        top_k = int(torch.randint(1, 5, (), generator=g))
        depth = int(torch.randint(1, 5, (), generator=g))
        total = int(torch.randint(2, top_k + depth * top_k ** 2 + 2, (), generator=g))
        T = int(torch.randint(1, 10, (), generator=g))
        aux = torch.randn(1, T, 3 * HIDDEN, generator=g) * 3
        ids = torch.randint(0, VOCAB, (1, T + 1), generator=g)
        tree = E.draft_tree(draft, aux, ids, top_k, depth, total)
        where = f"case {case}: top_k={top_k} depth={depth} total_tokens={total}"
        parents = tree.parents.tolist()
        assert len(parents) == total and parents[0] == -1, where
        assert tree.tokens[0] == ids[0, -1], where
        assert all(0 <= parents[i] < i for i in range(1, total)), where       # parent first
        paths = [path_to(parents, i) for i in range(total)]
        for i, path in enumerate(paths):
            assert tree.mask[i].nonzero().flatten().tolist() == sorted(path), where
            assert tree.positions[i] == len(path) - 1, where
        assert max(len(p) for p in paths) <= depth + 2, where
        leaves = [i for i in range(total) if i not in parents]
        width = max(len(p) for p in paths)
        assert tree.retrieve_indices.tolist() == [paths[leaf] + [-1] * (width - len(paths[leaf]))
                                                  for leaf in leaves], where
        for node in range(total):
            children = [int(tree.tokens[c]) for c in range(total) if parents[c] == node]
            assert len(children) == len(set(children)), where            # distinct siblings
            assert len(children) <= top_k, where
        if draft.cfg.has_vocab_map:                                 # drafted ids mapped by d2t
            assert set(tree.tokens[1:].tolist()) <= set(kept.tolist()), where


# ----------------------------------------------------------------------------------------
# speculative decoding is lossless


SPEC_TARGETS = {  # target -> draft vocab (None: the target's) and whether it is sharpened
    "llama": dict(kept=None, sharpen=True),
    "qwen3": dict(kept=torch.tensor([0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 18, 19,
                                     20, 21, 22]), sharpen=True),
    "qwen2": dict(kept=None, sharpen=False),
}
REFERENCE_TOKENS = 48  # greedy text beyond every output, for the deepest possible tree paths


@pytest.fixture(scope="module")
def speculation(zoo):
    """Per target: a drafter, two prompts and transformers' greedy text for both. Sharpened
    drafters were taught the greedy text of the 'memorized' prompt (drafts go deep) but not
    of the 'fresh' one; the unsharpened drafter knows neither."""
    setups = {}
    for i, (name, spec) in enumerate(SPEC_TARGETS.items()):
        hf, target = zoo.hf(name), zoo.target(name)
        prompts = dict(memorized=random_prompt(100 + i, length=8), fresh=random_prompt(200 + i, 8))
        reference = {kind: hf_greedy(hf, p, REFERENCE_TOKENS) for kind, p in prompts.items()}
        if spec["sharpen"]:
            draft = random_draft(target, seed=i, kept=spec["kept"])
            others = [random_prompt(300 + i * 10 + j, 8) for j in range(2)]
            texts = [torch.cat([p[0], hf_greedy(hf, p, REFERENCE_TOKENS)]) for p in others]
            texts.append(torch.cat([prompts["memorized"][0], reference["memorized"]]))
            sharpen(draft, target, torch.stack(texts), kept=spec["kept"])
        else:
            draft = random_draft(target, seed=i, std=0.3)
            with torch.no_grad():
                draft.lm_head.weight.mul_(3)
        setups[name] = SimpleNamespace(hf=hf, target=target, draft=draft, kept=spec["kept"],
                                       prompts=prompts, reference=reference)
    return setups


COMBOS = [  # (target, prompt, top_k, depth, total_tokens, max_new_tokens)
    ("llama", "memorized", 1, 1, 2, 32),     # a chain of one draft
    ("llama", "memorized", 1, 4, 6, 32),     # a chain at the pool maximum 1 + 4*1 + 1
    ("llama", "fresh", 1, 3, 5, 32),
    ("llama", "memorized", 2, 1, 7, 32),     # depth 1, pool maximum 2 + 1*4 + 1
    ("llama", "fresh", 3, 1, 5, 32),
    ("llama", "memorized", 2, 3, 15, 32),    # pool maximum 2 + 3*4 + 1
    ("llama", "memorized", 3, 2, 10, 7),     # the budget ends inside a round
    ("llama", "fresh", 4, 3, 20, 32),
    ("llama", "memorized", 4, 5, 40, 32),
    ("llama", "fresh", 2, 2, 4, 1),          # only the prefill's token
    ("llama", "memorized", 10, 7, 60, 32),   # the official default tree
    ("qwen3", "memorized", 1, 2, 4, 32),     # chain at the pool maximum
    ("qwen3", "fresh", 2, 1, 3, 32),
    ("qwen3", "memorized", 2, 2, 11, 32),    # pool maximum 2 + 2*4 + 1
    ("qwen3", "memorized", 3, 3, 16, 32),
    ("qwen3", "fresh", 3, 4, 40, 32),        # pool maximum 3 + 4*9 + 1
    ("qwen3", "memorized", 5, 2, 25, 32),
    ("qwen3", "fresh", 4, 1, 21, 32),        # depth 1, pool maximum 4 + 16 + 1
    ("qwen2", "fresh", 2, 3, 8, 32),         # an unsharpened random drafter
    ("qwen2", "memorized", 4, 4, 60, 32),
    ("qwen2", "fresh", 1, 5, 7, 32),         # chain at the pool maximum
]


def combo_id(c):
    return f"{c[0]}-{c[1]}-k{c[2]}-d{c[3]}-n{c[4]}-m{c[5]}"


def run_combo(speculation, combo):
    name, kind, top_k, depth, total, max_new = combo
    s = speculation[name]
    result = E.speculative_generate(s.target, s.draft, s.prompts[kind], max_new,
                                    tree=E.TreeShape(top_k, depth, total))
    return s, result


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_greedy_speculative_equals_plain_greedy_and_transformers(speculation, combo):
    s, result = run_combo(speculation, combo)
    name, kind, max_new = combo[0], combo[1], combo[5]
    expected = s.reference[kind][:max_new].tolist()
    assert result.tokens.tolist() == expected
    assert E.greedy_generate(s.target, s.prompts[kind], max_new).tolist() == expected


def test_accept_length_is_longest_tree_path_matching_the_greedy_text(speculation):
    # Brute force: in each round, enumerate every node of the verified tree and keep the
    # deepest whose root-to-node tokens are the greedy text from the round's root on.
    deepest = 0
    for combo in COMBOS:
        s, result = run_combo(speculation, combo)
        text = s.reference[combo[1]].tolist()
        at = 0                                   # output index of this round's root
        assert len(result.rounds) == len(result.accept_lengths)
        for r, (round_, accept_length) in enumerate(zip(result.rounds, result.accept_lengths)):
            tokens, parents = round_.tree.tokens.tolist(), round_.tree.parents.tolist()
            assert tokens[0] == text[at], f"{combo_id(combo)} round {r}"
            matching = [len(p) - 1 for p in (path_to(parents, i) for i in range(len(tokens)))
                        if [tokens[j] for j in p] == text[at:at + len(p)]]
            assert accept_length == max(matching) + 1, f"{combo_id(combo)} round {r}"
            at += accept_length
            deepest = max(deepest, accept_length - 1)
    assert deepest >= 2, "no round accepted two drafts: the drafters are too weak to test trees"


class OracleDrafter:
    """A scripted drafter that knows the target's greedy text `sequence` (prompt included):
    draft position p predicts token p+2 with certainty. Its hidden state is the position.
    It records the target features it is fed (its fc inputs)."""

    def __init__(self, sequence, aux_layers=(2, 4, 5)):
        self.sequence = sequence
        self.cfg = SimpleNamespace(aux_layers=aux_layers, vocab_size=VOCAB, draft_vocab_size=VOCAB)
        self.fed = []

    def fc(self, aux):
        self.fed.append(aux.clone())
        return aux[..., :1] * 0

    def __call__(self, h, tokens, positions, mask, cache=None, start=0):
        B, T = tokens.shape
        return positions.to(h.dtype).reshape(1, T, 1).expand(B, T, 1)

    def logits(self, h):
        return 50.0 * F.one_hot(self.sequence[h[..., 0].long() + 2], VOCAB).to(h.dtype)

    def to_target_ids(self, draft_ids):
        return draft_ids

    def new_cache(self, length):
        return None


@pytest.mark.parametrize("top_k, depth, total", [(1, 3, 5), (2, 2, 7), (3, 4, 20), (4, 1, 6)])
def test_drafter_predicting_the_greedy_text_accepts_depth_plus_two_per_round(zoo, top_k, depth,
                                                                             total):
    prompt, max_new = random_prompt(12), 30
    text = hf_greedy(zoo.hf("llama"), prompt, max_new + depth + 3)
    oracle = OracleDrafter(torch.cat([prompt[0], text]))
    result = E.speculative_generate(zoo.target("llama"), oracle, prompt, max_new,
                                    tree=E.TreeShape(top_k, depth, total))
    assert result.tokens.tolist() == text[:max_new].tolist()
    # the prefill gives token 1; each round then emits depth+1 drafts and a bonus token
    assert len(result.accept_lengths) == math.ceil((max_new - 1) / (depth + 2))
    assert result.accept_lengths[:-1] == [depth + 2] * (len(result.accept_lengths) - 1)


def test_drafter_is_fed_target_features_of_its_aux_layers(zoo):
    # eagle_aux_hidden_state_layer_ids [0, 3, 6] (output of layer k) = inputs of layers 1, 4, 7.
    # The prefill features, then each round's root + accepted nodes: consecutive positions.
    target, prompt, max_new = zoo.target("llama"), random_prompt(13), 20
    cfg = E.read_draft_config(draft_config_dict(
        eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 3, 6])), target.cfg)
    text = hf_greedy(zoo.hf("llama"), prompt, max_new + 6)
    oracle = OracleDrafter(torch.cat([prompt[0], text]), aux_layers=cfg.aux_layers)
    result = E.speculative_generate(target, oracle, prompt, max_new, tree=E.TreeShape(2, 3, 8))
    fed = torch.cat(oracle.fed, dim=1)[0]                        # (positions, 3*D)
    assert len(oracle.fed) == len(result.rounds)                 # prefill + all but the last round
    assert fed.shape[0] == prompt.shape[1] + sum(result.accept_lengths[:-1])
    _, hidden_states = hf_forward(zoo.hf("llama"), torch.cat([prompt[0], text])[None])
    assert_close(fed, hf_aux(hidden_states, (1, 4, 7))[:fed.shape[0]])


def test_speculative_generate_stops_at_first_eos(speculation):
    s = speculation["llama"]
    text = s.reference["memorized"].tolist()
    first = next(i for i in range(8, 32) if text[i] not in text[:i])   # a token new at i >= 8
    expected = text[:first + 1]                                       # up to and with the EOS
    result = E.speculative_generate(s.target, s.draft, s.prompts["memorized"], 32,
                                    tree=E.TreeShape(3, 3, 12), eos_token_id=text[first])
    assert result.tokens.tolist() == expected
    assert E.greedy_generate(s.target, s.prompts["memorized"], 32, text[first]).tolist() == expected


# ----------------------------------------------------------------------------------------
# drafter checkpoints


def test_draft_checkpoint_round_trip_gives_identical_logits_and_trees(speculation, tmp_path):
    s = speculation["qwen3"]                                      # has d2t/t2d
    E.save_draft(s.draft, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
    official_keys = {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                     "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                     "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                     "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                     "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
                     "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert set(load_file(tmp_path / "model.safetensors")) == official_keys  # no embed_tokens
    loaded = E.load_draft(str(tmp_path), s.target)
    _, aux = s.target(s.prompts["fresh"])
    ids = torch.cat([s.prompts["fresh"], s.reference["fresh"][:1][None]], dim=1)
    h = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.logits(h), s.draft.logits(h))
    trees = E.draft_tree(loaded, aux, ids, 3, 3, 16), E.draft_tree(s.draft, aux, ids, 3, 3, 16)
    for a, b in zip(*trees):
        assert torch.equal(a, b)


def test_official_layout_drafter_loads_with_rope_base_10000(zoo, tmp_path):
    target = zoo.target("llama3-rope")           # rope_theta 500000 + llama3 scaling
    state = official_draft_dir(str(tmp_path), target)
    draft = E.load_draft(str(tmp_path), target)
    hs = HIDDEN // 4
    expected = 1.0 / 10000 ** (torch.arange(0, hs, 2, dtype=torch.float) / hs)
    assert torch.allclose(draft.cfg.inv_freq.cpu(), expected, rtol=1e-6, atol=0)
    for key, value in state.items():
        assert torch.equal(draft.state_dict()[key], value), key
    assert torch.equal(draft.embed_tokens.weight, zoo.hf("llama3-rope").model.embed_tokens.weight)
    assert draft.cfg.aux_layers == (2, 4, 5)


def test_eagle_aux_layer_ids_use_output_of_layer_convention(zoo, tmp_path):
    target = zoo.target("llama")
    L = LAYERS

    def aux_layers(ids):
        raw = draft_config_dict(eagle_config=dict(eagle_aux_hidden_state_layer_ids=ids))
        return E.read_draft_config(raw, target.cfg).aux_layers

    assert aux_layers([1, L // 2 - 1, L - 4]) == (2, L // 2, L - 3)
    assert aux_layers([0, 3, 6]) == (1, 4, 7)
    # and save_draft writes them back in the same (output-of-layer) convention
    draft = random_draft(target, seed=1,
                         eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 3, 6]))
    E.save_draft(draft, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]


def break_d2t_range(state):
    state["d2t"][-1] = VOCAB              # draft id 19 -> target id 43


def break_t2d(state):
    state["t2d"][0], state["t2d"][4] = False, True   # same count, wrong ids


def drop_up_proj(state):
    state.pop("midlayer.mlp.up_proj.weight")


def narrow_fc(state):
    state["fc.weight"] = state["fc.weight"][:, :2 * HIDDEN].contiguous()


BAD_DRAFTS = {
    "d2t-outside-target-vocab": (break_d2t_range, r"d2t maps draft id 19 to target id 43, outside "
                                                  r"the target vocab \[0, 24\)"),
    "t2d-disagrees-with-d2t": (break_t2d, r"t2d disagrees with d2t"),
    "missing-key": (drop_up_proj, r"missing keys \['midlayer\.mlp\.up_proj\.weight'\]"),
    "wrong-fc-width": (narrow_fc, r"'fc\.weight'.* has shape \(64, 128\).*expects \(64, 192\)"),
}


@pytest.mark.parametrize("problem", list(BAD_DRAFTS))
def test_bad_draft_checkpoint_is_refused_naming_the_problem(zoo, tmp_path, problem):
    edit, message = BAD_DRAFTS[problem]
    target = zoo.target("llama")
    kept = torch.tensor([0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22])
    E.save_draft(random_draft(target, seed=2, kept=kept), str(tmp_path))
    state = load_file(tmp_path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(E.Eagle3Error, match=message):
        E.load_draft(str(tmp_path), target)


# ----------------------------------------------------------------------------------------
# tensor parallelism: torchrun --nproc_per_node=2 (gloo) equals one process

TP_TARGETS = ("llama", "qwen2", "qwen3")         # GQA; sharded biases; q/k norms, head_dim 24
TP_SHAPES = [(1, 3, 5), (3, 3, 12), (4, 2, 20)]  # speculative trees run under torchrun
TP_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tp_run(zoo, speculation, tmp_path_factory):
    """One torchrun launch with 2 ranks; returns each rank's results."""
    root = tmp_path_factory.mktemp("tp")
    prompt = random_prompt(21, length=10)
    job = dict(prompt=prompt, new_tokens=TP_NEW_TOKENS, shapes=TP_SHAPES, targets=[])
    for name in TP_TARGETS:
        draft_dir = str(root / f"draft-{name}")
        E.save_draft(speculation[name].draft, draft_dir)
        job["targets"].append(dict(name=name, dir=zoo.dir(name), draft=draft_dir,
                                   spec_prompt=speculation[name].prompts["memorized"]))
    torch.save(job, root / "job.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         os.path.abspath(__file__), "tp", str(root / "job.pt"), str(root)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    return SimpleNamespace(prompt=prompt, ranks=ranks)


def tp_worker(job_file, out_dir):
    """Runs on every rank: load each target sharded over the 2 ranks, then forward, greedy
    and speculative decoding; each rank saves what it computed."""
    rank = E.init_distributed().rank
    job = torch.load(job_file)
    results = dict(world=E.world_info()[1])
    for case in job["targets"]:
        target = E.load_target(case["dir"])
        draft = E.load_draft(case["draft"], target)
        layer = target.model.layers[0]
        logits, aux = target(job["prompt"])
        results[case["name"]] = dict(
            logits=logits, aux=aux,
            slices=dict(q=layer.self_attn.q_proj.weight.clone(),
                        o=layer.self_attn.o_proj.weight.clone(),
                        down=layer.mlp.down_proj.weight.clone()),
            greedy=E.greedy_generate(target, job["prompt"], job["new_tokens"]),
            speculative=[E.speculative_generate(target, draft, case["spec_prompt"],
                                                job["new_tokens"], tree=E.TreeShape(*shape))
                         for shape in job["shapes"]])
    for r in results.values():  # keep plain tensors and lists: what torch.load reads back
        if isinstance(r, dict):
            r["speculative"] = [(x.tokens, x.accept_lengths) for x in r["speculative"]]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_tensor_parallel_shards_attention_and_mlp_weights_across_ranks(zoo, tp_run):
    for name in TP_TARGETS:
        hf_layer = zoo.hf(name).model.layers[0]
        q, o = hf_layer.self_attn.q_proj.weight, hf_layer.self_attn.o_proj.weight
        down = hf_layer.mlp.down_proj.weight
        for r, rank in enumerate(tp_run.ranks):
            assert rank["world"] == 2
            s = rank[name]["slices"]
            rows, cols, inner = q.shape[0] // 2, o.shape[1] // 2, down.shape[1] // 2
            assert torch.equal(s["q"], q[r * rows:(r + 1) * rows]), name      # column-parallel
            assert torch.equal(s["o"], o[:, r * cols:(r + 1) * cols]), name   # row-parallel
            assert torch.equal(s["down"], down[:, r * inner:(r + 1) * inner]), name


def test_tensor_parallel_logits_and_aux_equal_single_process(zoo, tp_run):
    for name in TP_TARGETS:
        logits, aux = zoo.target(name)(tp_run.prompt)
        for rank in tp_run.ranks:
            # the all_reduce sums partial results in another order: fp32 round-off only
            assert_close(rank[name]["logits"], logits, name)
            assert_close(rank[name]["aux"], aux, name)
        assert torch.equal(tp_run.ranks[0][name]["logits"], tp_run.ranks[1][name]["logits"]), name


def test_tensor_parallel_greedy_generate_equals_single_process(zoo, tp_run):
    for name in TP_TARGETS:
        expected = hf_greedy(zoo.hf(name), tp_run.prompt, TP_NEW_TOKENS).tolist()
        one_process = E.greedy_generate(zoo.target(name), tp_run.prompt, TP_NEW_TOKENS)
        assert one_process.tolist() == expected
        for rank in tp_run.ranks:
            assert rank[name]["greedy"].tolist() == expected, name


def test_tensor_parallel_speculative_generate_equals_single_process(speculation, tp_run):
    deepest = 0
    for name in TP_TARGETS:
        s = speculation[name]
        expected = s.reference["memorized"][:TP_NEW_TOKENS].tolist()
        rank0, rank1 = (rank[name]["speculative"] for rank in tp_run.ranks)
        for shape, (tokens0, accepts0), (tokens1, accepts1) in zip(TP_SHAPES, rank0, rank1):
            one = E.speculative_generate(s.target, s.draft, s.prompts["memorized"], TP_NEW_TOKENS,
                                         tree=E.TreeShape(*shape))
            assert tokens0.tolist() == tokens1.tolist() == one.tokens.tolist() == expected, \
                (name, shape)
            assert accepts0 == accepts1 == one.accept_lengths, (name, shape)
            deepest = max(deepest, max(accepts0) - 1)
    assert deepest >= 2, "no round accepted two drafts under tensor parallelism"


if __name__ == "__main__":
    if sys.argv[1:2] == ["tp"]:
        tp_worker(*sys.argv[2:4])
    else:
        sys.exit(f"usage: torchrun --nproc_per_node=2 {sys.argv[0]} tp JOB_FILE OUT_DIR")

