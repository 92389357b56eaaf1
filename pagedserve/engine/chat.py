"""Chat templates: a conversation rendered into prompt token ids (LLM.chat and the server)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

Conversation = list[dict[str, Any]]

# apply_chat_template's own arguments: not variables of the template, so not chat_template_kwargs.
RESERVED_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
             "chat_template", "return_dict", "return_tensors", "tools", "documents", "padding", "truncation",
             "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


ROLES = ("system", "developer", "user", "assistant", "tool")


def developer_as_system(conversation: Conversation, template: Any) -> Conversation:
    """OpenAI's newer clients send `developer` for what was `system`: it reaches a template that
    knows the role as is, and one that does not as `system` (vLLM passes it through)."""
    if "developer" in str(template or "") or not any(m.get("role") == "developer" for m in conversation):
        return conversation
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in conversation]


def load_chat_template(template: str | None) -> str | None:
    """A chat template given as Jinja text, as the path of a file holding it, or as the name of
    one shipped with pagedserve (pagedserve/chat_templates: `hermes`)."""
    if template is None or "{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        from pagedserve.chat_templates import SHIPPED, shipped_template
        shipped = shipped_template(template)
        if shipped is not None:
            return shipped
        raise ValueError(f"chat_template {template!r} is neither a file, a Jinja template nor a shipped template "
                         f"({', '.join(SHIPPED)})")
    return path.read_text()


def render_chat(tokenizer, conversation: Conversation, add_generation_prompt: bool = True,
                chat_template: str | None = None, continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (or `chat_template`),
    with the tool definitions for templates that show them."""
    if not conversation:
        raise ValueError("messages must not be empty")
    for m in conversation:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"each message needs a role of system, developer, user, assistant or tool; got {m!r}")
    conversation = developer_as_system(conversation, chat_template or tokenizer.chat_template)
    reserved = RESERVED_KWARGS & set(chat_template_kwargs or ())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        chat_template=chat_template, continue_final_message=continue_final_message,
                                        tools=tools or None,
                                        **(chat_template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
