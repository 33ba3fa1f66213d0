"""Chat formats train on what the assistant says, nothing else; every format and file kind loads; packing keeps
documents apart."""

import json

import numpy as np
import pytest

from megatrain.data import DataError, Documents, chat_example, load_records, one_per_row, pack, to_example, tokenize

from .tokenizers import CHATML, chatml_tokenizer, llama3_tokenizer

CHAT = [{"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "And the capital of France?"},
        {"role": "assistant", "content": "Paris."}]


def _pieces(tok, pieces):
    """Token ids and trained flags of text pieces tokenized one by one: (text, trained) in order."""
    ids, train = [], []
    for text, trained in pieces:
        got = tok(text, add_special_tokens=False)["input_ids"]
        ids += got
        train += [trained] * len(got)
    return ids, train


@pytest.mark.parametrize("which", ["chatml", "llama3", "llama3-named"])
def test_assistant_only_masks_equal_hand_computed_masks(which):
    """The turns written out by hand, in the template's own text: the assistant's reply and its end-of-turn token
    are trained on; the system turn, the user turns, the role headers and what follows an end of turn are not.
    (llama3-named: the template --chat-template llama3 names, on a Llama-3 tokenizer.)"""
    if which == "chatml":
        tok = chatml_tokenizer()
        pieces = [("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is two plus two?"
                   "<|im_end|>\n<|im_start|>assistant\n", False), ("It is four.<|im_end|>", True),
                  ("\n<|im_start|>user\nAnd the capital of France?<|im_end|>\n<|im_start|>assistant\n", False),
                  ("Paris.<|im_end|>", True), ("\n", False)]
    else:
        tok = llama3_tokenizer()
        if which == "llama3-named":
            from megatrain.data.tokenizer import NAMED_TEMPLATES

            tok.chat_template = NAMED_TEMPLATES["llama3"][0]
        pieces = [("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n", False), ("It is four.<|eot_id|>", True),
                  ("<|start_header_id|>user<|end_header_id|>\n\nAnd the capital of France?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n", False), ("Paris.<|eot_id|>", True)]
    want_ids, want_train = _pieces(tok, pieces)
    ex = chat_example(CHAT, tok)
    assert ex.ids == want_ids
    assert ex.train == want_train
    assert sum(want_train) > 0 and not all(want_train)
    # the same through each chat format's fields
    share = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                               for m in CHAT]}
    for record, fmt in (({"messages": CHAT}, "messages"), (share, "sharegpt")):
        got = to_example(record, fmt, tok, {})
        assert (got.ids, got.train) == (want_ids, want_train)


def test_alpaca_with_and_without_a_chat_template():
    tok = chatml_tokenizer()
    rec = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
    ex = to_example(rec, "alpaca", tok, {})
    want = chat_example([{"role": "user", "content": "Add the numbers.\n\n2 and 2"},
                         {"role": "assistant", "content": "4"}], tok)
    assert (ex.ids, ex.train) == (want.ids, want.train)
    tok.chat_template = None
    ex = to_example(rec, "alpaca", tok, {})
    prompt = tok("### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 2\n\n### Response:\n")["input_ids"]
    reply = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.ids == prompt + reply and ex.train == [False] * len(prompt) + [True] * len(reply)


def test_prompt_completion_as_strings_and_as_messages():
    """TRL's prompt / completion: strings are the prompt's tokens (not trained) then the completion's and the end of
    text (trained); messages are the conversation they make, trained on the completion's assistant turns alone,
    not on an assistant turn of the prompt (a worked example in it)."""
    tok = chatml_tokenizer()
    ex = to_example({"prompt": "What is two plus two?", "completion": " It is four."}, "prompt_completion", tok, {})
    head = tok("What is two plus two?")["input_ids"]
    reply = tok(" It is four.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.ids == head + reply and ex.train == [False] * len(head) + [True] * len(reply)

    rec = {"prompt": CHAT[:3], "completion": CHAT[3:]}
    got = to_example(rec, "prompt_completion", tok, {})
    both = chat_example(CHAT, tok)  # trains on both replies
    assert got.ids == both.ids
    assert all(b or not g for g, b in zip(got.train, both.train)) and sum(got.train) < sum(both.train)
    assert _trained_runs(tok, got) == ["Paris.<|im_end|>"]
    with pytest.raises(DataError, match="must both be strings or both lists"):
        to_example({"prompt": "Hi", "completion": CHAT[1:2]}, "prompt_completion", tok, {})
    with pytest.raises(DataError, match="a completion without an assistant turn"):
        to_example({"prompt": CHAT[:1], "completion": CHAT[:1]}, "prompt_completion", tok, {})


def test_csv_cells_are_text_and_a_bad_header_is_named(tmp_path):
    """Each CSV cell as the text it holds: digits stay a string and an empty cell is an empty input, so a numeric
    completion trains as the others do; a header that does not name each column once is refused."""
    tok = chatml_tokenizer()
    tok.chat_template = None
    data = tmp_path / "pc.csv"
    data.write_text('prompt,completion\n"2+2=","4"\n"Say hi.","Hello, there."\n')
    docs = tokenize(load_records(str(data)), tok, source=str(data))
    want = [to_example({"prompt": p, "completion": c}, "prompt_completion", tok, {})
            for p, c in (("2+2=", "4"), ("Say hi.", "Hello, there."))]
    assert docs.ids.tolist() == [i for e in want for i in e.ids]
    assert docs.train.tolist() == [t for e in want for t in e.train]
    alpaca = tmp_path / "alpaca.csv"
    alpaca.write_text('instruction,input,output\n"Say hi.",,"Hello."\n')
    got = tokenize(load_records(str(alpaca)), tok)
    assert got.ids.tolist() == to_example({"instruction": "Say hi.", "output": "Hello."}, "alpaca", tok, {}).ids
    for header in ("prompt,prompt", "prompt,", ""):
        bad = tmp_path / "bad.csv"
        bad.write_text(header + ("\n" if header else ""))
        with pytest.raises(DataError, match="bad.csv"):
            load_records(str(bad))


def test_every_format_and_file_kind_loads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = chatml_tokenizer()
    records = {
        "text": [{"text": "Paris is the capital of France."}, {"text": "The quick brown fox."}],
        "alpaca": [{"instruction": "Say hi.", "input": "", "output": "Hello there."}] * 2,
        "prompt_completion": [{"prompt": "Say hi.", "completion": " Hello there."}] * 2,
        "sharegpt": [{"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}] * 2,
        "messages": [{"messages": CHAT}] * 2,
    }
    for fmt, recs in records.items():
        (tmp_path / f"{fmt}.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
        docs = tokenize(load_records(str(tmp_path / f"{fmt}.jsonl")), tok, source=fmt)  # the format detected
        want = [to_example(r, fmt, tok, {}) for r in recs]
        assert len(docs) == 2 and docs.ids.tolist() == [i for e in want for i in e.ids]
        assert docs.train.tolist() == [t for e in want for t in e.train]
    pq.write_table(pa.Table.from_pylist(records["messages"]), tmp_path / "chat.parquet")
    (tmp_path / "plain.json").write_text(json.dumps(records["text"]))
    (tmp_path / "notes.txt").write_text("First document.\n\nSecond document,\nstill the second.\n")
    assert len(tokenize(load_records(str(tmp_path / "chat.parquet")), tok)) == 2
    assert len(tokenize(load_records(str(tmp_path / "plain.json")), tok)) == 2
    assert len(tokenize(load_records(str(tmp_path / "notes.txt")), tok)) == 2  # a document per paragraph
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("\n".join(json.dumps({"body": r["text"]}) for r in records["text"]))
    assert len(tokenize(load_records(str(renamed)), tok, columns={"text": "body"})) == 2
    with pytest.raises(DataError, match=r"renamed.jsonl: a record with fields \['body'\] is none of the formats"):
        tokenize(load_records(str(renamed)), tok, source=str(renamed))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl record 2: field 'messages' must be a list of"):
        tokenize(load_records(str(bad)), tok, source=str(bad))


def test_packed_rows_keep_documents_apart_and_hold_every_trained_token():
    docs = Documents.of([to_example({"text": t}, "text", chatml_tokenizer(), {})
                         for t in ("Paris is the capital of France.", "Hi.", "The quick brown fox jumps over it.")])
    packed, single = pack(docs, 8, 0), one_per_row(docs, 32, 0)
    assert packed.tokens == single.tokens == len(docs.ids)
    # positions restart at each document and at each row; a document's first token in a row is not trained on
    starts = packed.real & (packed.positions == 0)
    assert starts[:, 0].all() and not packed.train[starts].any()
    # every other token keeps the document's flag (text: all trained): the longer documents are cut every 8 tokens
    assert packed.train.sum() == len(docs.ids) - starts.sum() and packed.cut == sum(int(n) > 8 for n in docs.lengths)
    assert single.train.sum() == len(docs.ids) - len(docs)


def test_packing_keeps_every_document_whole_in_one_row():
    """Best fit decreasing: each document of at most a row's tokens lies whole in one row, positions 0.. and its
    tokens and flags as they were, trained exactly where it is trained alone in a row of its own; the rows are
    full but for the least padding the order allows; a longer document is cut every row's length."""
    rng = np.random.default_rng(0)
    seq, lengths = 64, rng.integers(1, 65, size=300).tolist() + [64, 150]
    ids = rng.integers(3, 900, size=sum(lengths)).astype(np.int32)
    train = rng.random(len(ids)) < 0.7
    rows = pack(Documents(ids, train, np.asarray(lengths, dtype=np.int64)), seq, 0)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    want = {(s, n) for s, n in zip(starts[:-1], lengths[:-1])} | {(starts[-1], 64), (starts[-1] + 64, 64),
                                                                   (starts[-1] + 128, 22)}
    by_tokens = {ids[s: s + n].tobytes(): (s, n) for s, n in want}
    found = set()
    for r in range(len(rows)):
        pos, real = rows.positions[r], rows.real[r]
        for b in [k for k in range(seq) if real[k] and pos[k] == 0]:
            end = b + 1
            while end < seq and real[end] and pos[end] == end - b:
                end += 1
            s, n = by_tokens[rows.ids[r, b:end].tobytes()]  # a whole document (or part of the long one)
            assert n == end - b and np.array_equal(rows.train[r, b:end], train[s: s + n] & (np.arange(n) > 0))
            found.add((s, n))
    assert found == want and rows.cut == 1 and rows.tokens == sum(lengths)
    assert len(rows) <= 1.05 * -(-sum(lengths) // seq)  # nearly full rows (here 170 for at least 164)
    short = Documents(ids[: starts[-1]], train[: starts[-1]], np.asarray(lengths[:-1], dtype=np.int64))
    whole = pack(short, seq, 0)
    assert whole.cut == 0 and whole.train.sum() == one_per_row(short, seq, 0).train.sum()


def test_a_template_that_renders_the_last_reply_otherwise_trains_each_reply_as_the_conversation_renders_it():
    """Qwen3-style: the reply after the last user message opens with an empty reasoning block, earlier ones do not,
    so a reply rendered last is not a prefix of the conversation. Each reply is trained on as the whole conversation
    renders it, with its end-of-turn token; nothing else is. A template whose prompts are not prefixes of the
    conversation, or that changes a reply's text, is refused."""
    from .tokenizers import REASONING_CHATML

    tok = chatml_tokenizer()
    tok.chat_template = REASONING_CHATML
    ex = chat_example(CHAT, tok)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert full == ("<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nIt is four.<|im_end|>\n"
                    "<|im_start|>user\nAnd the capital of France?<|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\nParis.<|im_end|>\n")
    assert ex.ids == tok(full, add_special_tokens=False)["input_ids"]
    assert _trained_runs(tok, ex) == ["It is four.<|im_end|>", "<think>\n\n</think>\n\nParis.<|im_end|>"]
    tok.chat_template = "{{ messages | length }} turns\n" + CHATML
    with pytest.raises(DataError, match="does not render a conversation as each turn's prompt"):
        chat_example(CHAT, tok)
    tok.chat_template = REASONING_CHATML.replace("m['content'] + '<|im_end|>", "m['content'] | upper + '<|im_end|>")
    with pytest.raises(DataError, match="does not render a conversation as each turn's prompt"):
        chat_example(CHAT, tok)


def _trained_runs(tok, ex):
    """The example's trained tokens, each run of them decoded."""
    runs, cur = [], []
    for i, t in zip(ex.ids + [None], ex.train + [False]):
        if t:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                         "b": {"type": "number"}}}}}]
TOOL_CHAT = [{"role": "user", "content": "What is two plus two?"},
             {"role": "assistant", "tool_calls": [{"type": "function",
                                                   "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
             {"role": "tool", "name": "add", "content": "4"},
             {"role": "assistant", "content": "It is four."}]


def test_tool_calls_are_trained_on_and_tool_results_and_definitions_are_not(tmp_path):
    """A conversation with tool definitions, an assistant's tool call (no content), the tool's result and the
    answer: the call and the answer are trained on, each with its end-of-turn token; the definitions (rendered in)
    and the result are not. The same records read from a JSONL file, where the columnar reader gives every message
    every key (None where it has none) and the tools as a JSON string in one record, train the same tokens."""
    from .tokenizers import TOOL_CHATML

    tok = chatml_tokenizer()
    tok.chat_template = TOOL_CHATML
    ex = to_example({"messages": TOOL_CHAT, "tools": TOOLS}, "messages", tok, {})
    full = tok.decode(ex.ids)
    assert full.startswith('<|im_start|>system\nTools: [{"type": "function", "function": {"name": "add"')
    assert '<|im_start|>tool\n4<|im_end|>' in full
    assert _trained_runs(tok, ex) == ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|im_end|>',
                                      "It is four.<|im_end|>"]
    plain = {"messages": CHAT}
    data = tmp_path / "tools.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ({"messages": TOOL_CHAT, "tools": json.dumps(TOOLS)}, plain)))
    docs = tokenize(load_records(str(data)), tok, source=str(data))
    want = [ex, to_example(plain, "messages", tok, {})]
    assert docs.ids.tolist() == [i for e in want for i in e.ids]
    assert docs.train.tolist() == [t for e in want for t in e.train]
    with pytest.raises(DataError, match="field 'tools' is a string but not JSON"):
        to_example({"messages": TOOL_CHAT, "tools": "[{"}, "messages", tok, {})
    with pytest.raises(DataError, match="may be empty where it has 'tool_calls'"):
        to_example({"messages": [TOOL_CHAT[0], {"role": "assistant", "content": None}]}, "messages", tok, {})


def test_sharegpt_tool_use_is_the_messages_tool_calls():
    """ShareGPT's tool turns as LLaMA-Factory writes them (function_call: the call's JSON; observation: the result;
    the tools as a JSON string) train exactly as the same conversation in messages."""
    from .tokenizers import TOOL_CHATML

    tok = chatml_tokenizer()
    tok.chat_template = TOOL_CHATML
    share = {"conversations": [{"from": "human", "value": "What is two plus two?"},
                               {"from": "function_call", "value": json.dumps({"name": "add",
                                                                              "arguments": {"a": 2, "b": 2}})},
                               {"from": "observation", "value": "4"},
                               {"from": "gpt", "value": "It is four."}], "tools": json.dumps(TOOLS)}
    got = to_example(share, "sharegpt", tok, {})
    messages = [{k: v for k, v in m.items() if k != "name"} for m in TOOL_CHAT]  # (ShareGPT names no tool)
    want = to_example({"messages": messages, "tools": TOOLS}, "messages", tok, {})
    assert (got.ids, got.train) == (want.ids, want.train) and sum(got.train) > 0
    share["conversations"][1]["value"] = "add(2, 2)"
    with pytest.raises(DataError, match=r"conversations\[1\]: a function_call's value must be the JSON"):
        to_example(share, "sharegpt", tok, {})


def test_a_template_that_drops_tool_calls_or_a_turns_text_is_warned_of_once(capsys):
    """A template without tool support (Llama-3's here) renders an assistant's tool call as an empty reply, and
    Qwen3-style reasoning in an earlier reply is left out of the rendering: one warning line each, per tokenizer,
    naming what is missing; a template that keeps everything says nothing."""
    from .tokenizers import TOOL_CHATML

    tok = llama3_tokenizer()
    calls = [TOOL_CHAT[0], {**TOOL_CHAT[1], "content": ""}, *TOOL_CHAT[2:]]  # (this template needs a content)
    for _ in range(2):
        to_example({"messages": calls}, "messages", tok, {})
    err = capsys.readouterr().err.splitlines()
    assert err == ["megatrain train: warning: the chat template leaves out the tool calls of assistant turns (the "
                   "call of 'add' is not in the rendering): those turns train without them; a template with tool "
                   "support keeps them (--chat-template FILE)"]
    tok = chatml_tokenizer()
    tok.chat_template = TOOL_CHATML
    to_example({"messages": TOOL_CHAT, "tools": TOOLS}, "messages", tok, {})
    assert capsys.readouterr().err == ""
    tok.chat_template = CHATML.replace("m['content']", "m['content'].split('</think>')[-1]")
    thinking = [CHAT[0], {"role": "assistant", "content": "<think>2 and 2</think>It is four."}, *CHAT[2:]]
    for _ in range(2):
        chat_example(thinking, tok)
    assert capsys.readouterr().err.splitlines() == [
        "megatrain train: warning: the chat template leaves out part of the text of a turn (assistant: "
        "'<think>2 and 2</think>It is four.'): such turns train as the template renders them"]
