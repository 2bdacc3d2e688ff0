"""The scaffold of both test files (test_eagle3_ref.py, test_eagle3_tools.py): tiny random
models and drafters, a tiny chat target with its own tokenizer, the command-line launchers,
the method's inner steps called one at a time, and transformers as the reference. Fixtures
and helpers only, no tests: a test file imports what it uses by name (a module-scoped
fixture imported into a test module is built once for that module)."""
import argparse
import fcntl
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
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


# ----------------------------------------------------------------------------------------
# tiny random models of every family

ZOO = {  # name -> (model_type, seed, config overrides): the tiny targets most tests share
    "llama": ("llama", 0, {}),                               # GQA: 4 query heads, 2 kv heads
    "mistral": ("mistral", 1, dict(sliding_window=None)),
    "qwen2": ("qwen2", 2, {}),                               # q/k/v biases
    "qwen3": ("qwen3", 3, dict(head_dim=24)),                # q/k norms, head_dim != 64 / 4
    "llama3-rope": ("llama", 4, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "yarn": ("llama", 5, dict(rope_parameters=dict(              # also scales cos/sin
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128))),
    "tied": ("llama", 6, dict(tie_word_embeddings=True)),
    # DeepSeek-V3-like: q_lora, 4 groups of 2 experts with 2 kept, v_head_dim != nope, YaRN
    # whose mscale != mscale_all_dim (cos/sin factor != 1, softmax mscale^2), eps != 1e-6
    "ds-v3": ("deepseek_v3", 1, dict(
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=2, moe_intermediate_size=32, rms_norm_eps=1e-5,
        routed_scaling_factor=2.5, rope_scaling=dict(
            type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.707))),
    # Kimi-K2-like: plain q_proj, n_group = 1, 2 shared experts, one dense layer, YaRN with
    # beta 1/1 (a hard step between scaled and unscaled dims)
    "kimi": ("deepseek_v3", 0, dict(
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
        first_k_dense_replace=1, moe_intermediate_size=16, rms_norm_eps=1e-6,
        routed_scaling_factor=2.827, rope_scaling=dict(
            type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=1,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
}
TARGETS = [name for name, (family, _, _) in ZOO.items() if family != "deepseek_v3"]
DS_TARGETS = [name for name, (family, _, _) in ZOO.items() if family == "deepseek_v3"]
TINY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=MAX_POS, eos_token_id=None, bos_token_id=None,
            pad_token_id=None)
DS_TINY = dict(num_key_value_heads=4, num_nextn_predict_layers=0, rope_theta=10000.0)


def tiny_model(family="llama", seed=0, std=0.25, gains=True, **config):
    """The one builder of tiny random transformers models: TINY's config, `config` over it,
    weights ~ N(0, std), norm gains ~ 1 + N(0, std) (SPEC §9); gains=False: gains 1, matrices
    from a generator of their own (the vocab-6 target's tuning). DeepSeek-V3: eager attention
    and experts, a random score-correction bias (the defaults would hide epsilon/norm bugs)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = {**TINY, **(DS_TINY if family == "deepseek_v3" else {}), **config}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not gains:
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
                continue
            torch.nn.init.normal_(p, std=std)
            if "norm" in name:
                p.add_(1.0)
        if family == "deepseek_v3":
            model.set_attn_implementation("eager")
            model.set_experts_implementation("eager")
            for module in model.modules():
                if isinstance(module, DeepseekV3TopkRouter):
                    module.e_score_correction_bias.normal_(std=0.05)
    return model.eval()


class Zoo:
    """ZOO's checkpoints, each built once per module on first use, seeded by the table."""

    def __init__(self, root):
        self.root, self.models, self.targets = root, {}, {}

    def hf(self, name):
        if name not in self.models:
            family, seed, overrides = ZOO[name]
            std = 0.2 if family == "deepseek_v3" else 0.25
            self.models[name] = tiny_model(family, seed, std, **overrides)
            self.models[name].save_pretrained(self.root / name)
        return self.models[name]

    def dir(self, name):
        self.hf(name)
        return str(self.root / name)

    def target(self, name):
        if name not in self.targets:
            self.targets[name] = E.load_target(self.dir(name))
        return self.targets[name]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("targets"))


def built_once(tmp_path_factory, name, build):
    """build(root) made once per session: under xdist the first worker builds, the other loads."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent / name     # this session's, both workers'
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "built.pt").exists():
            root.mkdir(exist_ok=True)
            torch.save(build(root), root / "built.pt")
    return torch.load(root / "built.pt", weights_only=False)


def random_prompt(seed, length=12):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def random_tree(seed, n_nodes=12):
    """Random tokens and random parents (each parent precedes its child)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n_nodes)]
    tokens = torch.randint(0, VOCAB, (n_nodes,), generator=g)
    return tokens, parents


def children(parents, node):
    return [c for c in range(len(parents)) if int(parents[c]) == node]


def shift_left(x, n):
    """x[:, t] <- x[:, t + n]; zeros enter at the end."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, :x.shape[1] - n] = x[:, n:]
    return out


def path_to(parents, node):
    """Root-to-node list of node indices, by walking parents."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


# ----------------------------------------------------------------------------------------
# drafters and their vocab maps


def draft_config(target_cfg, draft_vocab_size=None, **config):
    """A SpecForge drafter config shaped like one target layer (4 q / 2 kv heads)."""
    D = target_cfg.hidden_size
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=D,
               intermediate_size=2 * D, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-6, max_position_embeddings=target_cfg.max_positions,
               rope_theta=10000.0, vocab_size=target_cfg.vocab_size, tie_word_embeddings=False)
    if draft_vocab_size is not None:
        raw["draft_vocab_size"] = draft_vocab_size
    return dict(raw, **config)


def tiny_draft(target, seed, kept=None, std=0.1, own_embedding=False, **config):
    """Random drafter over `kept` target ids (None: the target's vocab, no map)."""
    raw = draft_config(target.cfg, None if kept is None else len(kept), **config)
    draft = E.new_draft(E.read_draft_config(raw, target.cfg), target, own_embedding=own_embedding)
    E.init_weights(draft, seed, std, skip=lambda name: not E.owned(draft, name))
    return draft if kept is None else set_vocab_map(draft, kept)


def set_vocab_map(draft, kept):
    """Draft id i <-> target id kept[i] (ascending): d2t[i] = kept[i] - i."""
    kept = torch.tensor(sorted(int(k) for k in kept))
    with torch.no_grad():
        draft.d2t.copy_(kept - torch.arange(len(kept)))
        draft.t2d.zero_()
        draft.t2d[kept] = True
    return draft


def sharpen(draft, target, texts, steps=60):
    """Adam (lr 1e-2) of the 3-step TTT loss on greedy `texts`: deep paths (SPEC §9)."""
    with torch.no_grad():
        logits, aux = target(texts, aux_layers=draft.cfg.aux_layers)
    params = E.trainable(draft)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        loss = E.ttt_loss(draft, aux, texts, torch.ones_like(texts), logits, steps=3).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.requires_grad_(False)


def edit_draft_dir(path, config=None, state=None):
    """Rewrite a saved model's config.json and/or weights through the edits: each changes
    its dict in place, or returns a dict to write instead."""
    def edited(edit, d):
        new = edit(d)
        return new if isinstance(new, dict) else d
    if config:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(edited(config, raw), f)
    if state:
        weights = load_file(os.path.join(path, "model.safetensors"))
        save_file(edited(state, weights), os.path.join(path, "model.safetensors"))
    return path


# ----------------------------------------------------------------------------------------
# running the command line


def cli_env(**extra):
    """A child's env: our modules importable, one thread, no torchrun variables."""
    here = os.path.dirname(os.path.abspath(E.__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8", **extra,
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def cli(*args, world=1, cwd=None, script=E.__file__):
    """`python SCRIPT ARGS` started now, as a user runs it; world 2: torchrun on 2 ranks."""
    launcher = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    return subprocess.Popen(launcher + [os.path.abspath(script)] + [str(a) for a in args],
                            cwd=cwd, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, encoding="utf-8")


def finish(*procs, timeout=600):
    """Wait for processes started together -> CompletedProcess each."""
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def run_cli(*args, **kwargs):
    return finish(cli(*args, **kwargs))[0]


def cli_here(*argv, main=E.main):
    """main(ARGV) in this process, instrumentable -> (returncode, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as stopped:
        main([str(a) for a in argv])
    return SimpleNamespace(returncode=stopped.value.code, stdout=out.getvalue(),
                           stderr=err.getvalue())


def last_json(proc):
    """The one JSON object a command prints last."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refused(proc):
    """The one error line of a refused CLI run; nothing else reaches stderr."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


# ----------------------------------------------------------------------------------------
# the method's inner steps, for the tests that drive them one at a time: each is called from
# here only, so a change of signature is mended in one place


def verify(target, cache, n, tree, aux_layers=None):
    """verify_tree: the tree's N nodes after n cached tokens -> (logits (N, V), aux)."""
    return E.verify_tree(target, cache, n, tree, aux_layers or target.cfg.default_aux_layers)


def grow(drafter, cache, n, h_last, root, shape, preset="official", **preset_fields):
    """grow_tree with a preset's scoring and draft offset (some fields replaced) -> Tree."""
    preset = E.as_preset(preset)._replace(**preset_fields)
    engine = E.EngineDrafter(drafter, preset.probabilities, preset.draft_pos_offset)
    return E.grow_tree(engine, cache, n, h_last, root, shape)


def train_draft(target, draft, examples, held_out, cfg, out_dir, pad_id, resume=False, **kw):
    """train_draft on the target's live forward."""
    return E.train_draft(E.live_inputs(target, pad_id), draft, examples, held_out, cfg, out_dir,
                         resume, **kw)


def ttt_batch(target, draft, examples, pad_id, **kw):
    return E.ttt_batch(E.live_inputs(target, pad_id), draft, examples, **kw)


def train_step(target, draft, opt, examples, pad_id, step, cfg):
    return E.train_step(E.live_inputs(target, pad_id), draft, opt, examples, step, cfg)


def sent(target, run):
    """run() and the collectives it sent through the target's TP group -> (result, Tally)."""
    mark = target.tp.sent.copy()
    result = run()
    return result, target.tp.sent.since(mark)


# ----------------------------------------------------------------------------------------
# transformers as the reference


def hf_forward(model, ids):
    """transformers' logits (T, V) and hidden states (tuple of (T, D)) for one sequence."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def hf_aux(hidden_states, layers):
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def hf_greedy(model, ids, max_new_tokens, eos=None):
    """transformers' greedy new tokens (stop at `eos`); pad-valued prompt ids visible."""
    ids = torch.as_tensor(ids).view(1, -1)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    return out[0, ids.shape[1]:]


def pick(p, u):
    """The documented inverse CDF (never a zero-probability token) -> (token, u's edge distance)."""
    p = torch.as_tensor(p)
    cdf = torch.cumsum(p, 0) / p.sum()
    token = min(int((cdf <= u).sum()), int(p.nonzero().max()))
    low = float(cdf[token - 1]) if token else 0.0
    return token, min(u - low, float(cdf[token]) - u)


def inverse_cdf(p, u):
    return pick(p, u)[0]


def hf_warped_probs(scores, sampling):
    """softmax after transformers' warpers: temperature, top-k, top-p (official: top-p first)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    scores = scores.double()
    top_k = [TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else []
    top_p = [TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []
    warpers = [TemperatureLogitsWarper(sampling.temperature)] + (
        top_k + top_p if sampling.warpers == E.TRANSFORMERS_ORDER else top_p + top_k)
    for warp in warpers:
        scores = warp(None, scores)
    return scores.softmax(-1)


# ----------------------------------------------------------------------------------------
# a tiny chat target (its own tokenizer), conversations in both file formats, training

TRAIN_AUX = (2, 4, 5)
TRAIN_TINY = dict(hidden_size=32, intermediate_size=64, max_position_embeddings=256)


def train_config(**overrides):
    return E.TrainConfig(**dict(dict(steps=4, batch=4, lr=1e-2, warmup=1, ttt_steps=3,
                                     eval_every=1000, save_every=1000, seed=0), **overrides))


def train_top_ids(counts, n):
    """The n most frequent ids, ties to the smaller id, as a sorted list (plain Python)."""
    return sorted(sorted(range(len(counts)), key=lambda v: (-counts[v], v))[:n])


@pytest.fixture(scope="module")
def train_chat_target(tmp_path_factory):
    """A BPE tokenizer trained on synthetic chats and a random 8-layer llama in one HF dir;
    special, single-byte and pad lm_head rows scaled down: greedy text is distinct merges."""
    root = tmp_path_factory.mktemp("chat_target")
    texts = [E.chat_text(p, r) for p, r in E.synthetic_corpus(300, seed=11)]
    tok = E.train_tokenizer(texts, 400)
    vocab = -(-len(tok) // 64) * 64
    hf = tiny_model(seed=12, vocab_size=vocab, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, **TRAIN_TINY)
    quiet = [i for i in range(vocab) if i >= len(tok) or len(tok.convert_ids_to_tokens(i)) < 2
             or tok.convert_ids_to_tokens(i) in (E.USER, E.ASSISTANT, E.END)]
    with torch.no_grad():
        hf.lm_head.weight[quiet] *= 0.01
    hf.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return SimpleNamespace(dir=str(root / "target"), hf=hf, tok=tok, vocab=vocab, root=root)


def train_render(tok, messages):
    """Our rendering of the tiny chat template -> (ids, mask over assistant content, <|end|>)."""
    tokens, mask = [], []
    for m in messages:
        body = tok(m["content"], add_special_tokens=False).input_ids
        if m["role"] == "assistant":
            reply = body + [tok.convert_tokens_to_ids(E.END)]
            tokens += [tok.convert_tokens_to_ids(E.ASSISTANT)] + reply
            mask += [0] + [1] * len(reply)
        else:
            tokens += [tok.convert_tokens_to_ids(E.USER)] + body
            mask += [0] * (1 + len(body))
    return tokens, mask


def reply_token_counts(tok, chats):
    """Counter of the assistant tokens of `chats` under our rendering of the template."""
    return Counter(t for m in chats for t, reply in zip(*train_render(tok, m)) if reply)


TRAIN_CHATS = [  # multi-turn, with a system turn, in both file formats
    [dict(role="system", content="You are brief."), dict(role="user", content="Count to three."),
     dict(role="assistant", content="one, two, three."), dict(role="user", content="Again?"),
     dict(role="assistant", content="Sure: one, two, three.")],
]


def pair_chats(pairs):
    return [[dict(role="user", content=p), dict(role="assistant", content=r)] for p, r in pairs]


def train_conversations():
    """18 conversations: 16 synthetic single-turn ones, plus two multi-turn ones."""
    chats = pair_chats(E.synthetic_corpus(16, seed=13))
    return chats[:8] + TRAIN_CHATS + chats[8:] + TRAIN_CHATS


def chat_data(path, chats=None):
    """A JSONL chat file of `chats` (default: train_conversations()) -> its path."""
    chats = train_conversations() if chats is None else chats
    path.write_text("\n".join(train_jsonl_line(i, m) for i, m in enumerate(chats)) + "\n")
    return path


def train_jsonl_line(i, messages):
    """Even lines ShareGPT ({from, value}), odd lines OpenAI ({role, content})."""
    if i % 2 == 0:
        who = dict(user="human", assistant="gpt", system="system")
        return json.dumps(dict(id=str(i), conversations=[
            {"from": who[m["role"]], "value": m["content"]} for m in messages]))
    return json.dumps(dict(messages=messages))


# ----------------------------------------------------------------------------------------
# a drafter that has memorised the chat target's reply to one prompt (the generate commands)

TRAIN_GEN_PROMPT = "What is the capital of peru?"


def train_chat_prompt_ids(tok, prompt):
    """Our rendering of the chat-templated prompt with the generation prompt appended."""
    ids, _ = train_render(tok, [dict(role="user", content=prompt)])
    return ids + [tok.convert_tokens_to_ids(E.ASSISTANT)]


@pytest.fixture(scope="module")
def train_generate_setup(train_chat_target):
    """A drafter over 64 ids that memorised the target's reply to the prompt."""
    c = train_chat_target
    target = E.load_target(c.dir, dtype=torch.float32)
    prompt = train_chat_prompt_ids(c.tok, TRAIN_GEN_PROMPT)
    reply = hf_greedy(c.hf, prompt, 24, c.tok.eos_token_id).tolist()
    kept = sorted(set(reply))
    kept += [v for v in range(c.vocab) if v not in kept][:64 - len(kept)]
    draft = tiny_draft(target, 61, kept, std=0.02)
    example = E.Example(prompt + reply, [0] * len(prompt) + [1] * len(reply))
    train_draft(target, draft, [example] * 2, [], train_config(steps=40, batch=2),
                  str(c.root / "spec_draft"), c.tok.pad_token_id)
    return SimpleNamespace(draft_dir=str(c.root / "spec_draft"))


# ----------------------------------------------------------------------------------------
# wrong input through a command line: path flags and the one error line


class CLITables(NamedTuple):
    """A command line and the tables its path checks read."""
    build_parser: object
    path_flags: dict
    file_outputs: tuple
    main: object


REF_CLI = CLITables(E.build_parser, E.PATH_FLAGS, E.FILE_OUTPUTS, E.main)


def cli_commands(tables):
    """{command: its parser} of a command line."""
    parser = tables.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def cli_path_flags(tables, only=None):
    """(command, dest) of every path-taking flag of every command, read off the parser."""
    return [(command, action.dest) for command, parser in cli_commands(tables).items()
            if only is None or command in only
            for action in parser._actions
            if action.dest in tables.path_flags or action.dest == "out"]


def cli_path_kind(tables, command, dest):
    if dest == "out":
        return "out_file" if command in tables.file_outputs else "out_dir"
    return tables.path_flags[dest]


def cli_required_argv(tables, command, tmp_path):
    """`command` with a value for each required flag that passes every path check."""
    (tmp_path / "a_dir").mkdir(exist_ok=True)
    (tmp_path / "a_file").write_text("{}\n")
    value = dict(dir=tmp_path / "a_dir", file=tmp_path / "a_file", any=tmp_path / "a_dir",
                 out_file=tmp_path / "trace.safetensors", out_dir=tmp_path / "out")
    argv = [command]
    for action in cli_commands(tables)[command]._actions:
        if action.required:
            given = (value[cli_path_kind(tables, command, action.dest)]
                     if action.dest in tables.path_flags or action.dest == "out" else
                     dict(prompt="hi", tp="2", temperature="1")[action.dest])
            argv += [action.option_strings[-1], str(given)]
    return argv


def cli_with(argv, flag, path):
    """argv with `flag` set to `path` (replacing the value it had)."""
    if flag in argv:
        argv = argv[:argv.index(flag)] + argv[argv.index(flag) + 2:]
    return argv + [flag, str(path)]


def check_path_flag(tables, command, dest, tmp_path, monkeypatch):
    """A path flag refuses a missing, wrong-kind or unreadable (unwritable) path."""
    flag, kind = "--" + dest.replace("_", "-"), cli_path_kind(tables, command, dest)
    argv = cli_required_argv(tables, command, tmp_path)
    missing = tmp_path / "no_such" / "thing" if kind == "out_file" else tmp_path / "no_such"
    if kind != "out_dir":  # a missing output dir is created
        line = refused(cli_here(*cli_with(argv, flag, missing), main=tables.main))
        assert f"{flag} {str(missing)!r}" in line and "does not exist" in line, line
    wrong = dict(dir=(tmp_path / "a_file", "is a file; expected a directory"),
                 file=(tmp_path / "a_dir", "is a directory; expected a file"),
                 out_file=(tmp_path / "a_dir", "is a directory; expected the path of the file"),
                 out_dir=(tmp_path / "a_file", "is a file; expected a directory")).get(kind)
    if wrong:
        line = refused(cli_here(*cli_with(argv, flag, wrong[0]), main=tables.main))
        assert f"{flag} {str(wrong[0])!r} {wrong[1]}" in line, line
    # unreadable (or, for --out, unwritable): os.access says no, as it does for a user
    # without the permission (root passes every permission check, so it is asked here)
    (tmp_path / "locked_dir").mkdir()
    (tmp_path / "locked_file").write_text("{}\n")
    blocked = str(tmp_path / ("locked_dir" if kind in ("dir", "any") else
                              "locked_file" if kind == "file" else ""))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: os.path.abspath(p) != os.path.abspath(
        blocked) and real_access(p, mode))
    path = dict(out_file=tmp_path / "trace.safetensors", out_dir=tmp_path / "new_out").get(
        kind, blocked)
    line = refused(cli_here(*cli_with(argv, flag, path), main=tables.main))
    assert flag in line and ("not readable" in line or "cannot be written" in line), line


@pytest.fixture(scope="module")
def bad_inputs(train_chat_target, train_generate_setup, tmp_path_factory):
    """A working target dir, drafter dir and chat file, and broken copies of each."""
    c, root = train_chat_target, tmp_path_factory.mktemp("bad_inputs")
    chats = chat_data(root / "chats.jsonl")
    lines = chats.read_text().splitlines()
    broken_chats = root / "broken.jsonl"
    broken_chats.write_text("\n".join(lines[:2] + [lines[2][:-7]] + lines[3:]) + "\n")
    turnless = root / "turnless.jsonl"
    turnless.write_text("\n".join(lines[:4] + ['{"messages": ["hi", "there"]}']) + "\n")
    target, draft = root / "target", root / "draft"
    shutil.copytree(c.dir, target)
    shutil.copytree(train_generate_setup.draft_dir, draft)
    (target / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,\n')
    (draft / "config.json").write_text("{'architectures': ['LlamaForCausalLMEagle3']}")
    heads = root / "draft_heads"
    shutil.copytree(train_generate_setup.draft_dir, heads)
    edit_draft_dir(str(heads), config=lambda raw: raw.update(num_attention_heads=5))
    no_tokenizer = root / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(c.dir, name), no_tokenizer)
    return SimpleNamespace(root=root, target=c.dir, draft=train_generate_setup.draft_dir,
                           vocab=c.vocab, chats=str(chats), broken_chats=str(broken_chats),
                           turnless=str(turnless),
                           broken_target=str(target), broken_draft=str(draft),
                           draft_heads=str(heads), no_tokenizer=str(no_tokenizer))


def check_bad_input(bad_inputs, argv, expected, as_a_user=False, main=E.main, script=E.__file__):
    args = argv(bad_inputs)
    proc = (run_cli(*args, cwd=bad_inputs.root, script=script) if as_a_user else
            cli_here(*args, main=main))
    line = refused(proc)
    assert re.search(expected, line), line
    assert proc.stdout == "", proc.stdout[-2000:]
    for wrong in ("repo", "hub", "must be one of ('tree', 'chain')", "weight file"):
        assert wrong not in line.lower(), line
