"""Regenerate the demo's model folder: `python demo/make_model.py` (deterministic).

The folder holds what the orchestrator needs of a model, and nothing of its weights: a
byte-level BPE tokenizer trained here on the demo datasets' text plus a fixed list of
common words (`tokenizer.json`, 1,024 ids), a `tokenizer_config.json` with a ChatML chat
template that, like Qwen3's, drops `<think>...</think>` reasoning from assistant turns
before the last user message, and a `generation_config.json` naming the end-of-generation
ids (`<|im_end|>` and `<|endoftext|>`).

The input order is fixed and training gave the same bytes on every run tried with the
locked `tokenizers` version, so `tests/unit/test_task_chat.py` checks that the committed
files equal what this script produces, byte for byte; a `tokenizers` upgrade that trains
differently shows up there, and rerunning this script updates the files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

DEMO_DIR = Path(__file__).resolve().parent
DATA_DIR = DEMO_DIR / "data"
MODEL_DIR = DEMO_DIR / "model"

#: The tokenizer's size, special and added tokens included.
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Added but not special (as in Qwen3): decoding with special tokens skipped keeps them.
THINK_TOKENS = ("<think>", "</think>")

# Words a tiny chat model's completions and the framing around them use, so they tokenize
# in few pieces even where the datasets never say them.
COMMON_WORDS = """
the a an and or but if then so because of to in on at by for with from as is are was were
be been it its this that these those there here what which who how many much more less
each every all some no not yes one two three four five six seven eight nine ten eleven
twelve hundred thousand number numbers answer answers question final total sum difference
product plus minus times divided equals equal left now have has had gets gives away boxes
let me think step first next add subtract multiply carry result so the answer is i you we
user assistant system tutor careful solve reply just only number please thanks hello
about after again against also always another any around ask back before being below
between both came can come could day did different do does done down during end even
find for found get give go going good great group hand help her him his home house into
just keep kind know large last later learn line little long look made make man may mean
might money most move must my name need never new next night number off often old once
open other our out over own page part people place point put read right same say see
seem set she should show side small sound spell start still study such take tell than
thank their them they thing think thought through time together too try turn under until
up us use very want water way well went when where while why will word work world would
write year your zero half double twice count counting check again correct wrong because
therefore compute computing calculation value values equation problem problems example
"""

# ChatML, with Qwen3's treatment of reasoning: an assistant turn after the last user
# message keeps (or, when it is the final message, gets an empty) <think> block; earlier
# ones keep only the text after </think>. `enable_thinking=false` pre-fills an empty block.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def training_text() -> Iterator[str]:
    """The demo datasets' questions, answers and messages, then the common words, in order."""
    for name in ("arith.jsonl", "chat.jsonl"):
        for line in (DATA_DIR / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            for message in row.get("messages", ()):
                yield message["content"]
            if "question" in row:
                yield row["question"]
            yield row["answer"]
    yield from COMMON_WORDS.split()
    yield " ".join(COMMON_WORDS.split())
    yield "<think>\nLet me add the numbers first.\n</think>\n\nThe answer is 42."


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer


def _json(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def model_files() -> dict[str, str]:
    """The file name and text of each file of the model folder."""
    tokenizer = train_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _json(tokenizer_config),
        "generation_config.json": _json(generation_config),
    }


def main() -> None:
    MODEL_DIR.mkdir(exist_ok=True)
    for name, text in model_files().items():
        (MODEL_DIR / name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
