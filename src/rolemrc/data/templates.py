"""Messages -> token ids and loss labels: the ONE place that renders chat templates.

Works with any tokenizer chat template, including the official Llama-3.1 and Qwen2.5 ones,
which carry no ``{% generation %}`` markers: the text of assistant turn ``i`` is found by
rendering ``messages[:i]`` with the generation prompt (the prefix) and ``messages[:i+1]``
(the prefix plus the turn). The trained span is the turn's text up to and including the
end-of-turn marker (``<|eot_id|>``, ``<|im_end|>``); anything the template adds after it
(ChatML's newline) is context, not target.

The rendered text is cut at span boundaries and each piece tokenised on its own, so the
labelled tokens decode to exactly the assistant turns, and a prompt tokenises exactly as it
does at generation time (prompt ids, then the model's own tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolemrc import asset
from rolemrc.config import check_pair_lengths
from rolemrc.data.schemas import Message
from rolemrc.objectives.logprobs import IGNORE_INDEX

SHIPPED_TEMPLATES = {"llama3": "llama3.jinja", "chatml": "chatml.jinja"}


def load_template(spec: str) -> str:
    """``llama3``/``chatml`` (shipped), or a path to a Jinja file."""

    if spec in SHIPPED_TEMPLATES:
        return Path(asset(f"templates/{SHIPPED_TEMPLATES[spec]}")).read_text()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template {spec!r}: not a shipped name ({', '.join(SHIPPED_TEMPLATES)}) nor a file")
    return path.read_text()


class TemplateRenderError(ValueError):
    """The chat template cannot render one conversation (it refuses its turn order, or the
    turns cannot be cut into prompt and target); a property of the record, not of the run."""


# Content no template changes (no whitespace to trim): where it lands in a rendered one-turn
# conversation marks the end of the text before the first assistant turn.
_SENTINEL = "RoleMRCsentinel7f3a"


@dataclass
class EncodedConversation:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX except on assistant content + end-of-turn tokens
    truncated: bool

    @property
    def n_trained(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)

    @property
    def n_predicted(self) -> int:
        """Trained tokens the loss sees: a row's first token has no token before it to predict it from."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


@dataclass
class EncodedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]  # response tokens incl. end-of-turn
    rejected_ids: list[int]
    prompt_truncated: bool
    response_truncated: bool


class ChatFormat:
    """Renders conversations with ``tokenizer``'s chat template and tokenises them.

    Args:
        tokenizer: a fast HF tokenizer with ``chat_template`` set (or pass ``template``).
        template: overrides the tokenizer's template (shipped name or Jinja file).
        eot: end-of-turn marker; detected from the template when None.
    """

    def __init__(self, tokenizer: Any, template: str | None = None, eot: str | None = None) -> None:
        self.tokenizer = tokenizer
        if template is not None:
            tokenizer.chat_template = load_template(template)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; set model.chat_template to 'llama3', 'chatml' or a Jinja file"
            )
        self.eot = eot or self._detect_eot()

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # jinja's TemplateError (raise_exception in the template) and the like
            if isinstance(err, TemplateRenderError):
                raise
            raise TemplateRenderError(f"the chat template cannot render it: {type(err).__name__}: {err}") from err

    def _backend(self) -> Any:
        """The fast tokenizer's backend where it gives the tokenizer's own ids (what the tokenizer's
        call runs once it has switched truncation and padding off, without its per-call overhead:
        ~15% of encoding a conversation), else None."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None \
                or backend.encode_special_tokens != bool(getattr(self.tokenizer, "split_special_tokens", False)):
            return None
        return backend

    def tokenize(self, text: str) -> list[int]:
        # The template already wrote BOS and special tokens into the text.
        if not text:
            return []
        backend = self._backend()
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        """:meth:`tokenize` of each text (the same ids), in one call of the fast tokenizer's batch
        encoder where :meth:`tokenize` takes its direct path: no per-call overhead and no character
        offsets computed (~25% less work). It runs on the tokenizer's thread pool unless
        ``TOKENIZERS_PARALLELISM=false``."""
        backend = self._backend()
        if backend is None or not hasattr(backend, "encode_batch_fast"):
            return [self.tokenize(t) for t in texts]
        done = iter(backend.encode_batch_fast([t for t in texts if t], add_special_tokens=False))
        return [next(done).ids if t else [] for t in texts]

    def _detect_eot(self) -> str:
        probe = [{"role": "user", "content": "Q7x"}, {"role": "assistant", "content": "A9z"}]
        full = self.render(probe)
        after = full[full.rindex("A9z") + 3 :].strip()
        if not after:
            raise ValueError("could not detect the end-of-turn marker from the chat template; set model.eot_token")
        return after

    def assistant_spans(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character span of each
        assistant turn's content plus its end-of-turn marker."""
        full = self.render(messages)
        spans: list[tuple[int, int]] = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prefix = self._prefix_before_first_turn() if i == 0 else self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(prefix) and full.startswith(upto)):
                raise TemplateRenderError(
                    f"chat template is not prefix-consistent at message {i}: rendering a conversation's "
                    "first turns does not give a prefix of the whole; loss masks cannot be derived"
                )
            end = upto.rfind(self.eot, len(prefix))
            if end < 0:
                raise TemplateRenderError(f"end-of-turn marker {self.eot!r} not found after assistant message {i}")
            spans.append((len(prefix), end + len(self.eot)))
        return full, spans

    def _prefix_before_first_turn(self) -> str:
        """What the template writes before an assistant turn that opens the conversation (BOS, a
        default system prompt, the assistant header). Rendering no messages with the generation
        prompt would say it, but transformers refuses empty conversations; so render one
        assistant turn holding a sentinel and keep the text before it."""
        text = self.render([{"role": "assistant", "content": _SENTINEL}])
        if text.count(_SENTINEL) != 1:
            raise TemplateRenderError("the chat template does not render an opening assistant turn's content as is")
        return text[: text.index(_SENTINEL)]

    def encode_conversation(self, messages: list[Message], max_length: int | None = None) -> EncodedConversation:
        """``input_ids``/``labels`` for SFT; long conversations lose their start (left cut)."""
        pieces = self._conversation_pieces(messages)
        return _assemble([self.tokenize(text) for text, _ in pieces], [trained for _, trained in pieces], max_length)

    def encode_conversations(self, conversations: list[list[Message]],
                             max_length: int | None = None) -> list[EncodedConversation | TemplateRenderError]:
        """:meth:`encode_conversation` of each conversation (the same ids and labels), their pieces
        tokenised in one :meth:`tokenize_many` call; a conversation the template cannot render
        gives its :class:`TemplateRenderError` in its place."""
        cut: list[list[tuple[str, bool]] | TemplateRenderError] = []
        for messages in conversations:
            try:
                cut.append(self._conversation_pieces(messages))
            except TemplateRenderError as err:
                cut.append(err)
        ids = iter(self.tokenize_many([text for c in cut if isinstance(c, list) for text, _ in c]))
        return [c if isinstance(c, TemplateRenderError)
                else _assemble([next(ids) for _ in c], [trained for _, trained in c], max_length) for c in cut]

    def _conversation_pieces(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """The rendered conversation cut at the assistant spans: ``(text, trained)`` pieces."""
        text, spans = self.assistant_spans(messages)
        pieces: list[tuple[str, bool]] = []
        cursor = 0
        for start, end in spans:
            pieces += [(text[cursor:start], False), (text[start:end], True)]
            cursor = end
        pieces.append((text[cursor:], False))
        return pieces

    def encode_prompt(self, messages: list[Message]) -> list[int]:
        """Prompt ids ending with the generation prompt, as used for generation."""
        return self.tokenize(self.render(messages, add_generation_prompt=True))

    def encode_prompts(self, conversations: list[list[Message]]) -> list[list[int]]:
        """:meth:`encode_prompt` of each conversation (the same ids), tokenised in one batch call."""
        return self.tokenize_many([self.render(m, add_generation_prompt=True) for m in conversations])

    def encode_response(self, prompt: list[Message], response: str) -> list[int]:
        """Tokens of ``response`` as the assistant turn after ``prompt``, plus end-of-turn."""
        return self.tokenize(self._response_text(prompt, response))

    def _response_text(self, prompt: list[Message], response: str) -> str:
        text, spans = self.assistant_spans(prompt + [{"role": "assistant", "content": response}])
        start, end = spans[-1]
        return text[start:end]

    def encode_pair(
        self, prompt: list[Message], chosen: str, rejected: str, max_length: int, max_prompt_length: int
    ) -> EncodedPair:
        """Prompt cut from the left to ``max_prompt_length``, then each response cut from the
        right so prompt + response fits ``max_length``: every row is at most ``max_length``."""
        check_pair_lengths(max_length, max_prompt_length)
        prompt_ids = self.encode_prompt(prompt)
        return _cut_pair(prompt_ids, self.encode_response(prompt, chosen), self.encode_response(prompt, rejected),
                         max_length, max_prompt_length)

    def encode_pairs(self, pairs: list[tuple[list[Message], str, str]], max_length: int,
                     max_prompt_length: int) -> list[EncodedPair | TemplateRenderError]:
        """:meth:`encode_pair` of each ``(prompt, chosen, rejected)`` (the same ids), their texts
        tokenised in one :meth:`tokenize_many` call; a pair the template cannot render gives its
        :class:`TemplateRenderError` in its place."""
        check_pair_lengths(max_length, max_prompt_length)
        texts: list[list[str] | TemplateRenderError] = []
        for prompt, chosen, rejected in pairs:
            try:
                texts.append([self.render(prompt, add_generation_prompt=True), self._response_text(prompt, chosen),
                              self._response_text(prompt, rejected)])
            except TemplateRenderError as err:
                texts.append(err)
        ids = iter(self.tokenize_many([t for x in texts if isinstance(x, list) for t in x]))
        return [x if isinstance(x, TemplateRenderError)
                else _cut_pair(next(ids), next(ids), next(ids), max_length, max_prompt_length) for x in texts]


def _cut_pair(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int,
              max_prompt_length: int) -> EncodedPair:
    prompt_truncated = len(prompt_ids) > max_prompt_length
    if prompt_truncated:
        prompt_ids = prompt_ids[-max_prompt_length:]
    room = max_length - len(prompt_ids)
    response_truncated = max(len(chosen_ids), len(rejected_ids)) > room
    return EncodedPair(prompt_ids, chosen_ids[:room], rejected_ids[:room], prompt_truncated, response_truncated)


def _assemble(pieces: list[list[int]], trained: list[bool], max_length: int | None) -> EncodedConversation:
    """Token pieces -> ids and labels (the trained pieces labelled), cut from the left."""
    ids: list[int] = []
    labels: list[int] = []
    for piece, is_target in zip(pieces, trained, strict=True):
        ids += piece
        labels += piece if is_target else [IGNORE_INDEX] * len(piece)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, labels = ids[-max_length:], labels[-max_length:]
    return EncodedConversation(ids, labels, truncated)
