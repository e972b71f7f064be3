"""Chat requests' text side: the ``messages`` field read into role / content pairs, and the
model's chat template that renders them into the prompt text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lazyspec.server.limits import ROLES, ApiError


def parse_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages -> [{"role", "content"}] with text content (parts joined)."""
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(
                f"messages[{i}] must be an object with a role in {list(ROLES)}", param="messages"
            )
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return out


# OpenAI content part types that carry media: served models read text only (the vision
# tower of a vision-language checkpoint is not loaded)
MEDIA_PARTS = ("image_url", "input_audio", "video_url", "file")


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text"}`` parts
    (joined). A media part is refused by name (the model reads text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise ApiError(
                    f"messages[{i}].content[{j}] has type {kind!r}: this server reads text "
                    "only (image, audio, video and file input are not supported)",
                    param="messages",
                    code="unsupported_content",
                )
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ApiError(
        f"messages[{i}].content must be a string or a list of text parts", param="messages"
    )


class ChatTemplate:
    """Renders chat messages with the model's jinja2 chat template (sandboxed, no
    transformers), or as ``role: content`` lines ending in ``assistant:`` without one."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.specials = {"bos_token": bos_token, "eos_token": eos_token}
        self._template = None
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda v, indent=None: json.dumps(
                v, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _template_exception
            self._template = env.from_string(source)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate:
        """From ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``."""
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_path = folder / "chat_template.jinja"
        if source is None and jinja_path.is_file():
            source = jinja_path.read_text()
        return cls(
            source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        )

    def render(self, messages: list[dict[str, str]], extra: dict[str, Any] | None = None) -> str:
        """The prompt text; ``extra`` (``chat_template_kwargs``) adds template variables."""
        if self._template is None:
            return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        try:
            variables = {**(extra or {}), **self.specials}
            variables.update(messages=messages, add_generation_prompt=True)
            return self._template.render(**variables)
        except ApiError:
            raise
        except Exception as exc:  # a template error is the request's fault or the model's
            raise ApiError(
                f"the chat template failed on these messages: {exc}", param="messages"
            ) from None


def _template_exception(message: str) -> None:
    raise ApiError(f"chat template: {message}", param="messages")


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
