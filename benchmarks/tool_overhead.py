"""What a multi-turn run pays for running tools in worker processes and for the drift check.

    .venv/bin/python benchmarks/tool_overhead.py [--calls 300] [--conversations 64] [--repeats 5]

Measured in one run, medians over --repeats:

- tool calls: a trivial tool (``add``) called in this process (the baseline), then through rlctl's
  ``ToolPool`` (``rollout.multi_turn.tool_workers`` worker processes, each call a pipe round trip, the
  timeout enforced by the process): the cost of one call on one warm worker, the calls per second of two
  workers on a turn's batch of calls, and a worker's start (spawn, import) paid at its first call and
  after each timeout;
- the drift check: at the end of each conversation the rollout renders it whole with the chat template,
  encodes it and compares the ids (``MultiTurnRollout.drift``). Timed on --conversations conversations of
  two tool turns (call, answer, call, answer, final answer), built as the rollout builds them (the
  template's increments appended as ids), against one no-grad forward pass of a tiny model over the same
  padded batch (the step pays at least three: old log-probs, reference, update). With a real model
  (0.5B and up) the forward pass is hundreds of times dearer and the ratio shrinks accordingly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))  # the tests' chat tokenizer and tools: real, small, built here


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tool_calls(n: int, repeats: int) -> None:
    from rlctl.engine.tool_workers.pool import ToolPool

    import toolbox

    direct = median_time(lambda: [toolbox.add(i, 1.0) for i in range(n)], repeats) / n
    calls = [("toolbox:add", {"a": i, "b": 1.0}) for i in range(n)]
    with ToolPool(1, 30) as pool:
        t0 = time.perf_counter()
        pool.run(calls[:1])
        start = time.perf_counter() - t0
        one = median_time(lambda: pool.run(calls), repeats) / n
    with ToolPool(2, 30) as pool:
        pool.run(calls[:2])
        two = median_time(lambda: pool.run(calls), repeats) / n
    print(f"tool call in this process (baseline): {direct * 1e6:.1f} us")
    print(f"tool call on 1 warm worker process:   {one * 1e3:.3f} ms ({one / direct:.0f}x the baseline)")
    print(f"2 workers, a batch of {n} calls:       {1 / two:.0f} calls/s ({two * 1e3:.3f} ms per call)")
    print(f"a worker's start (its first call):    {start * 1e3:.0f} ms")


def conversations(count: int):
    """``count`` conversations of two tool turns, as the rollout builds them (its ids and messages)."""
    from rlctl.engine.rollout.chat import ChatIncrements, tool_message
    from rlctl.engine.rollout.multi_turn import Conversation
    from rlctl.tools.schema import function_schema

    from chat_tokenizer import build_chat_tokenizer
    from toolbox import lookup

    tok = build_chat_tokenizer()
    chat = ChatIncrements(tok, [function_schema(lookup, "lookup")], "the benchmark's tokenizer")
    countries = ["france", "peru", "italy", "japan"]
    convs = []
    for i in range(count):
        country = countries[i % len(countries)]
        prompt = f"what is the capital of {country}? ({i})"
        c = Conversation(prompt, (i, 0), messages=[{"role": "user", "content": prompt}])
        for turn, text in enumerate(
            [
                '<tool_call>{"name": "lookup", "arguments": {"country": "' + country + '"}}</tool_call>',
                '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>',
                f"the capital is {lookup(country)}",
            ]
        ):
            ids = chat.encode(text) + [tok.convert_tokens_to_ids("<|im_end|>")]
            c.ids += ids
            c.model += [True] * len(ids)
            c.messages.append({"role": "assistant", "content": text})
            if turn < 2:
                answer = lookup(country if turn == 0 else "peru")
                env = chat.closing(ids) + chat.tool_ids([("lookup", answer)])
                c.ids += env
                c.model += [False] * len(env)
                c.messages.append(tool_message("lookup", answer))
        convs.append(c)
    return tok, chat, convs


def drift_check(count: int, repeats: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlctl.engine.rollout.chat import first_drift

    tok, chat, convs = conversations(count)

    def check_all() -> int:
        drifted = 0
        for c in convs:  # what MultiTurnRollout.drift does for each conversation
            prompt = chat.encode(chat.render(c.messages[:1], True))
            full = chat.encode(chat.render(c.messages))
            drifted += first_drift(prompt + c.ids, full) is not None
        return drifted

    drifted = check_all()
    checking = median_time(check_all, repeats)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    ).eval()
    width = max(len(c.ids) for c in convs) + 40
    ids = torch.zeros(len(convs), width, dtype=torch.long)
    for i, c in enumerate(convs):
        ids[i, : len(c.ids)] = torch.tensor(c.ids)
    with torch.no_grad():
        forward = median_time(lambda: model(input_ids=ids), repeats)
    tokens = sum(len(c.ids) for c in convs)
    print(f"drift check, {count} conversations ({tokens} tokens, {drifted} drifting): {checking * 1e3:.1f} ms")
    print(f"one forward pass of a 2-layer 64-wide model over the same batch (baseline): {forward * 1e3:.1f} ms")
    print(f"drift check / that forward pass: {checking / forward:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tool_calls(args.calls, args.repeats)
    drift_check(args.conversations, args.repeats)


if __name__ == "__main__":
    main()
