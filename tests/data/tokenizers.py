"""Chat tokenizers built offline for the tests: a ChatML one (as Qwen2's: <|im_start|> / <|im_end|>, a default
system turn) and a Llama-3-style one (header tokens, <|eot_id|> closing each turn)."""

from __future__ import annotations

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you today?",
          "Streaming layers through a device one at a time.", "Paris is the capital of France.",
          "What is two plus two? It is four.", "Answer briefly and clearly."] * 20

CHATML = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
          "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ChatML whose replies after the last user message open with an empty reasoning block, as Qwen3's template renders
# them (earlier replies bare): a reply rendered as the conversation's last is not a prefix of a longer one
REASONING_CHATML = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ChatML with tool definitions in a system turn and an assistant's tool calls as JSON in <tool_call> tags
TOOL_CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + tools | tojson + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function | tojson + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# LLAMA3 with each reply (its text and <|eot_id|>) in a generation block: the assistant-token mask transformers
# returns, which TRL's assistant-only loss reads (megatrain renders it as LLAMA3)
LLAMA3_GENERATION = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def _bpe(specials: list[str], vocab: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def chatml_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def llama3_tokenizer():
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(specials), bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", pad_token="<|eot_id|>",
                                  additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"])
    tok.chat_template = LLAMA3
    return tok
