import pytest

from jrl.data import DEFAULT_PLAIN_FORMAT, PromptExample, PromptTemplate
from jrl.data.templates import encode_prompt

EXAMPLE = PromptExample(id=0, question="What is 3 + 4?", answer="7")


def test_plain_default_and_custom_format():
    assert PromptTemplate().render(EXAMPLE) == DEFAULT_PLAIN_FORMAT.format(
        question="What is 3 + 4?"
    )
    template = PromptTemplate(
        kind="plain", user_format="Q: {question}\nA (after ####, in {{braces}}):"
    )
    assert template.render(EXAMPLE) == "Q: What is 3 + 4?\nA (after ####, in {braces}):"


def test_question_braces_are_not_interpreted():
    template = PromptTemplate(user_format="{question}")
    assert template.render_question("set {x} = {0}") == "set {x} = {0}"


def test_chat_messages():
    template = PromptTemplate(
        kind="chat", user_format="{question} Answer after ####.", system="Be brief."
    )
    assert template.render(EXAMPLE) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 + 4? Answer after ####."},
    ]
    no_system = PromptTemplate(kind="chat", user_format="{question}")
    assert no_system.render_batch([EXAMPLE]) == [[{"role": "user", "content": "What is 3 + 4?"}]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "instruct"}, r"kind='instruct'.*\('plain', 'chat'\)"),
        ({"user_format": "no field"}, r"has fields \[\]"),
        ({"user_format": "{question} {answer}"}, r"has fields \['question', 'answer'\]"),
        ({"user_format": "{question}{question}"}, r"exactly once"),
        ({"user_format": "{question.__class__}"}, r"__class__"),
        ({"user_format": "{question"}, r"not a valid format string"),
        ({"kind": "plain", "system": "x"}, r"only used by kind='chat'"),
        ({"kind": "plain", "chat_template_kwargs": (("enable_thinking", False),)},
         r"chat_template_kwargs are only used by kind='chat'"),
        ({"kind": "chat", "chat_template_kwargs": (("messages", []),)},
         r"name 'messages' must be an identifier other than"),
    ],
)
def test_bad_templates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptTemplate(**kwargs)


def test_chat_template_kwargs_reach_the_tokenizer():
    class Recording:
        """A tokenizer that records what encode_chat was given."""

        def encode_chat(self, messages, **variables):
            self.seen = (messages, variables)
            return [1, 2]

    tokenizer = Recording()
    template = PromptTemplate(kind="chat", user_format="{question}",
                              chat_template_kwargs=(("enable_thinking", False),))
    assert encode_prompt(template, tokenizer, EXAMPLE) == [1, 2]
    assert tokenizer.seen == ([{"role": "user", "content": "What is 3 + 4?"}],
                              {"enable_thinking": False})
