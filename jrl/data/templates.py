"""Prompt templates: a question -> the text (or chat messages) the policy is asked to continue."""

from __future__ import annotations

import dataclasses
import string

from jrl.data.examples import PromptExample

TEMPLATE_KINDS = ("plain", "chat")

# The instruction names "####" because the default verifier (jrl.rewards.math_reward) reads it.
DEFAULT_PLAIN_FORMAT = (
    "Question: {question}\n"
    "Solve step by step, then give the final answer as a number after ####.\n"
    "Answer:"
)
DEFAULT_CHAT_FORMAT = (
    "{question}\nSolve step by step, then give the final answer as a number after ####."
)


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """How a question is put to the model.

    Attributes:
      kind: "plain" renders one string to tokenize as is; "chat" renders a message list
        [{"role": "system", ...}?, {"role": "user", "content": ...}] for a tokenizer's chat
        template (jrl.models) to turn into text.
      user_format: a str.format string whose only field is {question} (write literal braces as
        {{ and }}). None picks DEFAULT_PLAIN_FORMAT or DEFAULT_CHAT_FORMAT by kind.
      system: chat only: the system message, or None for no system message (the chat template may
        then add its own default). Must be None for kind="plain".
    """

    kind: str = "plain"
    user_format: str | None = None
    system: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in TEMPLATE_KINDS:
            raise ValueError(
                f"PromptTemplate: kind={self.kind!r} is not allowed; "
                f"allowed kinds: {TEMPLATE_KINDS}."
            )
        if self.user_format is None:
            default = DEFAULT_PLAIN_FORMAT if self.kind == "plain" else DEFAULT_CHAT_FORMAT
            object.__setattr__(self, "user_format", default)
        if not isinstance(self.user_format, str):
            raise ValueError(
                f"PromptTemplate: user_format={self.user_format!r} is not allowed; "
                "it must be a str."
            )
        try:
            fields = [
                field
                for _, field, _, _ in string.Formatter().parse(self.user_format)
                if field is not None
            ]
        except ValueError as error:
            raise ValueError(
                f"PromptTemplate: user_format={self.user_format!r} is not a valid format string "
                f"({error}); "
                "write literal braces as {{ and }}."
            ) from None
        if fields != ["question"]:
            raise ValueError(
                f"PromptTemplate: user_format={self.user_format!r} has fields {fields}; it must "
                "contain the field {question} exactly once and no other field (write literal "
                "braces as {{ and }})."
            )
        if self.system is not None:
            if self.kind != "chat":
                raise ValueError(
                    f"PromptTemplate: system={self.system!r} is only used by kind='chat', "
                    f"not kind={self.kind!r}; "
                    "put plain-prompt instructions in user_format."
                )
            if not isinstance(self.system, str):
                raise ValueError(
                    f"PromptTemplate: system={self.system!r} is not allowed; "
                    "it must be a str or None."
                )

    def render_question(self, question: str) -> str | list[dict[str, str]]:
        """The prompt for one question: a str ("plain") or a list of role/content messages."""
        user_text = self.user_format.format(question=question)
        if self.kind == "plain":
            return user_text
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        messages.append({"role": "user", "content": user_text})
        return messages

    def render(self, example: PromptExample) -> str | list[dict[str, str]]:
        """`render_question(example.question)`."""
        return self.render_question(example.question)

    def render_batch(self, examples: list[PromptExample]) -> list[str | list[dict[str, str]]]:
        """[B] prompts for [B] examples."""
        return [self.render(example) for example in examples]
