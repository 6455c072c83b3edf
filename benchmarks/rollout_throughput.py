"""Rollout throughput, single-turn against multi-turn, side by side in one run (a row of ``make bench``).

Run:  .venv/bin/python benchmarks/rollout_throughput.py                  # the defaults below
      .venv/bin/python benchmarks/rollout_throughput.py --generations 2 --reply-tokens 16 --repeats 1   # quicker

The policy is a random-init model of ``conf/model/tiny.yaml``'s shape (Llama layout, hidden 128, 2
layers, the shipped tiny Llama-3 tokenizer), sampled on CPU through rolemrc's HF engine
(:class:`rolemrc.rollout.hf.HFEngine`, KV cache on, temperature 1) from the twelve seeds of
``data=sample_dialogues``, ``--generations`` times each (GRPO's groups):

- **single-turn** (``env=none``): one reply per prompt, the prompts' rows generated at once, as
  GRPO's one-turn rollout does;
- **multi-turn** (``env=scripted``): whole conversations through :func:`rolemrc.env.roll`, the
  scripted user replaying each seed's later user turns (three replies per conversation), each turn
  one batched ``generate`` over the open conversations' running sequences.

A random model seldom samples the end-of-turn token: each reply is ``--reply-tokens`` sampled
tokens closed with the template's end of turn (a reply that samples it earlier ends there), so
every conversation runs its turns and both rows sample replies of the same length. Rates:
conversations/s, sampled (role-player) tokens/s, and every token of the final sequences
(prompt, replies, user turns) per second. Each row keeps its fastest of ``--repeats`` interleaved
rounds. Results: printed, and written as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "rollout_throughput.json"


def build(args: argparse.Namespace):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rolemrc import asset
    from rolemrc.data.templates import ChatFormat
    from rolemrc.env import ScriptedEnv
    from rolemrc.rollout.engine import Sampling
    from rolemrc.rollout.hf import HFEngine, pad_id_of, stop_token_ids

    tok = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    chat = ChatFormat(tok)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(  # conf/model/tiny.yaml's init
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)).eval()
    stops = stop_token_ids(tok, chat.eot)
    engine = HFEngine(stop_ids=stops, pad_id=pad_id_of(tok), sampling=Sampling(args.reply_tokens, True, 1.0))
    engine.sync(model, 0)
    eot = chat.tokenize(chat.eot)[0]
    rows = [json.loads(line) for line in open(asset("sample/dialogues.jsonl"), encoding="utf-8")]
    seeds = [{"messages": [{"role": m["role"].lower(), "content": m["content"]} for m in r["prompt"]],
              "columns": {"user_turns": r["user_turns"]}} for r in rows]
    seeds = [s for s in seeds for _ in range(args.generations)]

    def generate(prompts):
        """Each prompt's reply: sampled, closed with the end of turn when it did not stop."""
        outs = engine.generate(prompts, 1, [0])
        return [o if o and o[-1] in stops else [*o, eot] for o in outs]

    return chat, ScriptedEnv(), seeds, generate, stops


def single(chat, env, seeds, generate, stops) -> dict:
    prompts = chat.encode_prompts([s["messages"] for s in seeds])
    start = time.perf_counter()
    outs = generate(prompts)
    wall = time.perf_counter() - start
    sampled = sum(len(o) for o in outs)
    return {"conversations": len(seeds), "turns": 1.0, "wall_s": wall, "sampled_tokens": sampled,
            "sequence_tokens": sampled + sum(len(p) for p in prompts)}


def multi(chat, env, seeds, generate, stops, max_turns: int) -> dict:
    from rolemrc.env import roll

    start = time.perf_counter()
    convs = roll([env.reset(s) for s in seeds], chat, generate, stop_ids=stops, max_turns=max_turns)
    wall = time.perf_counter() - start
    return {"conversations": len(convs), "turns": sum(c.turns for c in convs) / len(convs), "wall_s": wall,
            "sampled_tokens": sum(sum(c.model_mask) for c in convs), "sequence_tokens": sum(len(c.ids) for c in convs),
            "ends": sorted({c.reason for c in convs})}


def rates(row: dict) -> dict:
    return {**row, "conversations_per_s": row["conversations"] / row["wall_s"],
            "sampled_tokens_per_s": row["sampled_tokens"] / row["wall_s"],
            "sequence_tokens_per_s": row["sequence_tokens"] / row["wall_s"]}


def table(result: dict) -> list[str]:
    lines = [f"Rollout throughput (tiny model, CPU, {result['seeds']} seeds x {result['generations']} generations, "
             f"replies of {result['reply_tokens']} tokens; fastest of {result['repeats']}):",
             f"  {'':12s} {'turns':>5s} {'conv/s':>8s} {'sampled tok/s':>14s} {'all tok/s':>10s} {'wall s':>7s}"]
    for name in ("single_turn", "multi_turn"):
        r = result[name]
        lines.append(f"  {name:12s} {r['turns']:5.1f} {r['conversations_per_s']:8.2f} {r['sampled_tokens_per_s']:14.1f} "
                     f"{r['sequence_tokens_per_s']:10.1f} {r['wall_s']:7.2f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generations", type=int, default=4, help="conversations per seed (GRPO's num_generations)")
    p.add_argument("--reply-tokens", type=int, default=32, help="sampled tokens per reply at most")
    p.add_argument("--max-turns", type=int, default=3, help="replies per multi-turn conversation at most")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each row keeps its fastest")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    parts = build(args)
    best: dict[str, dict] = {}
    for round_ in range(args.repeats):
        order = ("single_turn", "multi_turn") if round_ % 2 == 0 else ("multi_turn", "single_turn")
        for name in order:
            torch.manual_seed(round_)
            row = single(*parts) if name == "single_turn" else multi(*parts, args.max_turns)
            if name not in best or row["wall_s"] < best[name]["wall_s"]:
                best[name] = row
    result = {"seeds": len(parts[2]) // args.generations, "generations": args.generations,
              "reply_tokens": args.reply_tokens, "max_turns": args.max_turns, "repeats": args.repeats,
              **{name: rates(row) for name, row in best.items()},
              "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2),
              "platform": platform.platform(),
              "command": "python benchmarks/rollout_throughput.py " + " ".join(sys.argv[1:])}
    result["table"] = table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["table"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
