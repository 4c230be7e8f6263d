"""Turning a chat conversation into prompt text: the model's own chat template, or BloomBee's default."""

from bloombee.api.schemas import ChatMessage

# Used when the tokenizer has no chat template (bloombee-tiny and most base models): each message as
# "<|role|>\ncontent\n", then "<|assistant|>\n" for the reply; generation stops where the model starts a new turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_TEMPLATE_STOPS = ("<|user|>", "<|system|>", "<|assistant|>")


class ChatFormatter:
    """Renders conversations for one tokenizer; says which stop strings the template implies."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.own_template = bool(getattr(tokenizer, "chat_template", None))

    def render(self, messages: list[ChatMessage]) -> str:
        conversation = [{"role": message.role, "content": message.text()} for message in messages]
        template = None if self.own_template else DEFAULT_CHAT_TEMPLATE
        return self.tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True,
                                                  tokenize=False)

    def encode(self, messages: list[ChatMessage]) -> list[int]:
        """Prompt ids; a model's own template writes its special tokens itself, the default one gets the tokenizer's."""
        text = self.render(messages)
        return self.tokenizer(text, add_special_tokens=not self.own_template).input_ids

    @property
    def implied_stops(self) -> tuple[str, ...]:
        return () if self.own_template else DEFAULT_TEMPLATE_STOPS
