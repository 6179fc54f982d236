#!/usr/bin/env python3
"""The Python baseline of `cargo xtask bench data`: the same work as the Rust data pipeline with
transformers (`apply_chat_template`) and its fast tokenizer, on the same file: per conversation,
render up to each assistant turn with the generation prompt and with the turn, encode without
special tokens, diff the ids (one row, or one row per turn when the template rewrites earlier
turns), truncate, drop documents without 2 consecutive supervised tokens, and pack into rows.
Runs on `--workers` processes (the same cores as ours). Prints one JSON line:
{"seconds", "conversations", "documents", "tokens", "supervised_tokens", "rows"}.
"""
import argparse
import json
import multiprocessing
import sys
import time

from transformers import PreTrainedTokenizerFast

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TOK = None
ARGS = None


def init(target, args, ready):
    global TOK, ARGS
    TOK = PreTrainedTokenizerFast.from_pretrained(target)
    ARGS = args
    ready.wait()  # every worker has its tokenizer before the clock starts, as ours loads first


def documents(line):
    conv = json.loads(line)
    msgs, tools = conv["messages"], conv.get("tools")
    if not ARGS["thinking"]:
        msgs = [{k: v for k, v in m.items() if k not in REASONING_FIELDS} for m in msgs]

    def encode(ms, gen):
        text = TOK.apply_chat_template(ms, tools=tools, tokenize=False, add_generation_prompt=gen,
                                       enable_thinking=ARGS["thinking"])
        return TOK(text, add_special_tokens=False)["input_ids"]

    whole = encode(msgs, False)
    turns, is_prefix = [], True
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt, full = encode(msgs[:i], True), encode(msgs[: i + 1], False)
        start = 0
        while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
            start += 1
        turns.append((full, start))
        is_prefix = is_prefix and whole[: len(full)] == full
    if is_prefix:
        mask = [0] * len(whole)
        for full, start in turns:
            mask[start:len(full)] = [1] * (len(full) - start)
        docs = [(whole, mask)]
    else:
        docs = [(full, [0] * start + [1] * (len(full) - start)) for full, start in turns]
    kept = []
    for ids, mask in docs:
        ids, mask = ids[: ARGS["max_len"]], mask[: ARGS["max_len"]]
        if any(a and b for a, b in zip(mask, mask[1:])):
            kept.append((ids, mask))
    return kept


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--thinking", action="store_true")
    a = p.parse_args()
    args = {"max_len": a.max_len, "thinking": a.thinking}
    ready = multiprocessing.Barrier(a.workers + 1)
    with open(a.data, encoding="utf-8") as f, multiprocessing.Pool(a.workers, init, (a.target, args, ready)) as pool:
        ready.wait()
        start = time.perf_counter()
        convs = docs = tokens = supervised = rows = 0
        row_len = 0
        for kept in pool.imap(documents, f, chunksize=16):
            convs += 1
            for ids, mask in kept:  # next-fit packing into rows of max_len
                docs += 1
                tokens += len(ids)
                supervised += sum(mask)
                if rows == 0 or row_len + len(ids) > a.max_len:
                    rows += 1
                    row_len = 0
                row_len += len(ids)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "conversations": convs, "documents": docs, "tokens": tokens,
                      "supervised_tokens": supervised, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
