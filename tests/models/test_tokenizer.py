"""Tokenizers: ChatML rendering (native vs jinja vs transformers), loading, stops, CharTokenizer."""

from __future__ import annotations

import json

import pytest

from jrl.models import CharTokenizer, Tokenizer, load_gguf, load_tokenizer
from jrl.data.templates import ChatMLTemplate, parse_chatml_template, render_jinja_template
from jrl.models.tokenizer import HFTokenizer
from .helpers import SMOLLM2_TEMPLATE, tiny_gguf_source_model, write_tiny_gguf

PLAIN_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4*4?"},
]
EXPECTED_CHATML = ("<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                   "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                   "<|im_start|>assistant\n5<|im_end|>\n"
                   "<|im_start|>user\nAnd 4*4?<|im_end|>\n")
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "t.gguf",
                           tiny_gguf_source_model("llama"))
    return load_gguf(path)[2]


# ------------------------------------------------------------------------------------------------
# chat templates


def test_chatml_detection():
    assert parse_chatml_template(PLAIN_CHATML) == ChatMLTemplate(default_system=None)
    assert parse_chatml_template(SMOLLM2_TEMPLATE) == ChatMLTemplate(SMOLLM_SYSTEM)
    # Formatting variants (double quotes, no spaces, a real newline) are the same template.
    variant = PLAIN_CHATML.replace("'", '"').replace(" + ", "+").replace("\\n' }}", "\n' }}")
    assert parse_chatml_template(variant) == ChatMLTemplate(None)
    # Anything beyond plain ChatML goes to jinja.
    assert parse_chatml_template(PLAIN_CHATML.replace("message['content']",
                                                      "message['content'] | trim")) is None
    assert parse_chatml_template("{{ bos_token }}" + PLAIN_CHATML) is None
    assert parse_chatml_template(PLAIN_CHATML + "\n") is None


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chatml_output_for_fixed_conversation(add_generation_prompt):
    suffix = "<|im_start|>assistant\n" if add_generation_prompt else ""
    for template in (PLAIN_CHATML, SMOLLM2_TEMPLATE):
        rendered = parse_chatml_template(template).render(
            CONVERSATION, add_generation_prompt=add_generation_prompt)
        assert rendered == EXPECTED_CHATML + suffix
        assert rendered == render_jinja_template(template, CONVERSATION,
                                                 add_generation_prompt=add_generation_prompt)
    # Without a system message SmolLM2's template inserts its default one.
    user_only = CONVERSATION[1:2]
    smollm = parse_chatml_template(SMOLLM2_TEMPLATE).render(user_only, add_generation_prompt=True)
    assert smollm == (f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
                      "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert smollm == render_jinja_template(SMOLLM2_TEMPLATE, user_only,
                                           add_generation_prompt=True)


def test_chat_template_matches_transformers(gguf_tokenizer, tmp_path):
    import transformers

    gguf_tokenizer.save(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        expected = theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
        assert gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == expected
        assert gguf_tokenizer.encode_chat(messages) == theirs(expected,
                                                              add_special_tokens=False).input_ids


def test_non_chatml_template_uses_jinja(gguf_tokenizer):
    import dataclasses

    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
                "{{ eos_token }}{% endfor %}")
    tokenizer = dataclasses.replace(gguf_tokenizer, chat_template=template)
    assert tokenizer.apply_chat_template(CONVERSATION[1:3]) == (
        "<|im_start|>[USER] What is 2+3?<|im_end|>[ASSISTANT] 5<|im_end|>")


# A template with a switch, as Qwen3's has: enable_thinking=false prefills an empty think block.
THINKING_SWITCH = (PLAIN_CHATML + "{% if add_generation_prompt and enable_thinking is defined "
                   "and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")


def test_chat_template_variables_reach_the_template_as_in_transformers(gguf_tokenizer,
                                                                       tmp_path):
    import dataclasses

    import transformers

    tokenizer = dataclasses.replace(gguf_tokenizer, chat_template=THINKING_SWITCH)
    tokenizer.save(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATION[1:2]
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        expected = theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True, **variables)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **variables) == expected
    # Not vacuous: the switch changes the prompt.
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_a_variable_the_template_never_reads_is_refused(gguf_tokenizer):
    # A typo (enable_thinkng) would otherwise be ignored silently by jinja.
    with pytest.raises(ValueError, match=r"variables \['enable_thinkng'\]: this tokenizer's "
                                         r"chat template never reads them"):
        gguf_tokenizer.apply_chat_template(CONVERSATION[1:2], enable_thinkng=False)


def test_bad_messages_are_rejected(gguf_tokenizer):
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a string"):
        gguf_tokenizer.apply_chat_template([{"role": "user", "content": "a"},
                                            {"role": "assistant", "content": None}])
    # Multimodal content (a Qwen3.5 chat with an image part) is refused, naming the parts.
    image = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] is a list of parts "
                                         r"\(\['image', 'text'\]\): jrl trains text models only"):
        gguf_tokenizer.encode_chat([{"role": "user", "content": image}])


# ------------------------------------------------------------------------------------------------
# loading from files


def test_load_tokenizer_directory(gguf_tokenizer, tmp_path):
    gguf_tokenizer.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}  # the dict form
    config_path.write_text(json.dumps(config))
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, Tokenizer)
    assert loaded.eos_id == 0 and loaded.bos_id == 1
    assert loaded.stop_ids == (0, 2)  # eos and <|im_end|> (the template is ChatML)
    assert loaded.encode("Hello world 12") == gguf_tokenizer.encode("Hello world 12")
    assert loaded.with_stop_ids([5]).stop_ids == (0, 2, 5)
    # chat_template.jinja (newer transformers) takes precedence over tokenizer_config.json.
    (tmp_path / "chat_template.jinja").write_text(PLAIN_CHATML)
    assert load_tokenizer(tmp_path).apply_chat_template(CONVERSATION[1:2]) == (
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="expected a directory"):
        load_tokenizer(tmp_path / "vocab.txt")


def test_missing_chat_template_is_explained(gguf_tokenizer):
    import dataclasses

    with pytest.raises(ValueError, match="no chat_template"):
        dataclasses.replace(gguf_tokenizer, chat_template=None).apply_chat_template(CONVERSATION)


def test_unknown_special_token_is_rejected(gguf_tokenizer):
    with pytest.raises(ValueError, match="eos_token='<eos>' is not in the vocabulary"):
        HFTokenizer(backend=gguf_tokenizer.backend, eos_token="<eos>")


# ------------------------------------------------------------------------------------------------
# CharTokenizer


def test_special_token_texts_are_the_control_tokens(gguf_tokenizer):
    # The tiny GGUF vocabulary's three control tokens; the char tokenizer has none that text
    # could produce.
    assert set(gguf_tokenizer.special_token_texts) == {"<|endoftext|>", "<|im_start|>",
                                                       "<|im_end|>"}
    assert CharTokenizer().special_token_texts == ()


def test_char_tokenizer_round_trip_and_ids():
    tokenizer = CharTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    text = "12+34=46 what is 7*8? -3"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id == 1 and ids[-1] == tokenizer.eos_id == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == "<bos>" + text + "<eos>"
    # Deterministic ids: 3 specials, then the alphabet in order ("0" -> 3, "9" -> 12).
    assert tokenizer.encode("09+") == [3, 12, 13]
    assert tokenizer.pad_id == 0 and tokenizer.stop_ids == (2,)
    assert tokenizer.vocab_size == 3 + len(tokenizer.alphabet)
    assert CharTokenizer().encode(text) == tokenizer.encode(text)


def test_char_tokenizer_errors():
    # "@" is outside the default alphabet (digits, letters, "+-*/=()., ?:", newline and "#$%'!").
    with pytest.raises(ValueError, match=r"character '@' at position 2"):
        CharTokenizer().encode("12@")
    with pytest.raises(ValueError, match="id 99 is outside the vocabulary"):
        CharTokenizer(alphabet="0123456789").decode([3, 99])
    with pytest.raises(ValueError, match=r"duplicate characters \['1'\]"):
        CharTokenizer(alphabet="0112")
