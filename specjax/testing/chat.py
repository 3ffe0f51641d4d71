"""Chat fixtures for tests and recipes: the real Qwen3 and Llama-3.1 chat templates, tiny
byte-level BPE tokenizers that carry them, tiny random-weight chat targets and small
conversation files.

    from specjax.testing.chat import make_chat_target, write_conversations
    target = make_chat_target("out/chat-target", style="qwen3")
    write_conversations("out/chat.jsonl", "openai", n=20, seed=0)

The tokenizers are trained on a few standard-library files (seconds); the style's
special tokens are added on top, so the whole vocabulary stays within `vocab_size`.
"""

from __future__ import annotations

import json
import random

from specjax.errors import SpecjaxError

# Qwen/Qwen3 instruct models' tokenizer_config.json "chat_template" (the same text in the
# Qwen3 family, e.g. Qwen/Qwen3-0.6B and Qwen/Qwen3-8B), as copied by llama.cpp to
# models/templates/Qwen-Qwen3-0.6B.jinja (github.com/ggml-org/llama.cpp).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json "chat_template" (Llama-3.3-70B-Instruct
# ships the same text; llama.cpp copies it to models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja).
# It sets date_string = "26 Jul 2024" unless the caller passes one, so renders do not depend
# on today's date (the Llama-3.2 variant calls strftime_now instead; not used here).
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

STYLES = {
    # special tokens, template, bos, eos: as the released instruct tokenizers declare them
    # (Qwen3: eos <|im_end|>, no bos; Llama-3.1-Instruct: bos <|begin_of_text|>, eos
    # <|eot_id|>).
    "qwen3": (("<|im_start|>", "<|im_end|>", "<think>", "</think>"), QWEN3_TEMPLATE,
              None, "<|im_end|>"),
    "llama3": (("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"), LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"),
}


def _style(style: str):
    if style not in STYLES:
        raise SpecjaxError(f"unknown chat style {style!r}; expected one of {sorted(STYLES)}")
    return STYLES[style]


def make_chat_tokenizer(style: str, vocab_size: int = 512):
    """A byte-level BPE (`specjax.models.tokenizer.train_bpe` on stdlib texts) with the
    `style`'s ("qwen3" or "llama3") special tokens, chat template, bos and eos.

    Returns: a `transformers.PreTrainedTokenizerFast` of at most `vocab_size` tokens
      (`<|endoftext|>` 0 and `<|pad|>` 1 stay; the specials take the last ids).
    Raises: SpecjaxError for an unknown style or a `vocab_size` too small for the
      bytes, the two base specials and the style's."""
    from specjax.models.tokenizer import train_bpe
    from specjax.testing.tiny import stdlib_texts

    specials, template, bos, eos = _style(style)
    tok = train_bpe(stdlib_texts(12), vocab_size - len(specials))
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    assert len(tok) <= vocab_size, (len(tok), vocab_size)
    return tok


def make_chat_target(out_dir: str, style: str = "qwen3", vocab_size: int = 512,
                     seed: int = 0) -> str:
    """Writes a tiny random-weight target (`specjax.testing.tiny.tiny_config`, family
    qwen3 for style "qwen3", llama for "llama3") with a chat tokenizer of `style` to
    `out_dir`; its config's eos_token_ids are the end-of-turn id and `<|endoftext|>`.
    Returns `out_dir`."""
    from flax import nnx

    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config

    tok = make_chat_tokenizer(style, vocab_size)
    eot = tok.convert_tokens_to_ids(_style(style)[3])
    bos = tok.bos_token_id if style == "llama3" else None
    cfg = tiny_config(len(tok), family="qwen3" if style == "qwen3" else "llama",
                      eos_token_ids=(eot, 0), bos_token_id=bos)
    save_model(Transformer(cfg, rngs=nnx.Rngs(seed)), out_dir, tokenizer=tok)
    return out_dir


_SENTENCES = (
    "Return the sum of a list of numbers.", "What does os.path.join do?",
    "Sort the list in place and return None.", "Open the file and read every line.",
    "A generator yields values lazily.", "Why is the dictionary empty?",
    "Use a context manager to close the file.", "The function raises ValueError here.",
    "Split the string on commas.", "Explain how the cache is invalidated.",
    "Count the words in the text.", "Numbers: 1, 2, 3 and 42.",
    "Unicode works too: naïve café, 東京.", "Call it with keyword arguments only.",
)
_SYSTEMS = ("You are a helpful assistant.", "Answer briefly and precisely.")


def sample_conversations(n: int, seed: int) -> list[list[dict]]:
    """`n` deterministic conversations (normalised messages): every other one with a
    system turn, one to three user/assistant exchanges, some assistant contents with
    leading/trailing spaces or newlines."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": rng.choice(_SYSTEMS)}] if i % 2 == 0 else []
        for t in range(1 + rng.randrange(3)):
            user = " ".join(rng.sample(_SENTENCES, 2))
            reply = " ".join(rng.sample(_SENTENCES, 1 + rng.randrange(3)))
            if (i + t) % 4 == 3:
                reply = "\n " + reply + "  \n"
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append(msgs)
    return out


def write_conversations(path: str, fmt: str, n: int, seed: int) -> str:
    """Writes `sample_conversations(n, seed)` as JSONL in `fmt` ("openai": {"id",
    "messages"}; "sharegpt": {"id", "conversations": [{"from": system|human|gpt,
    "value"}]}) to `path`; returns `path`."""
    if fmt not in ("openai", "sharegpt"):
        raise SpecjaxError(f"unknown conversation format {fmt!r}; expected openai or sharegpt")
    sharegpt = {"system": "system", "user": "human", "assistant": "gpt"}
    with open(path, "w", encoding="utf-8") as f:
        for i, msgs in enumerate(sample_conversations(n, seed)):
            if fmt == "openai":
                rec = {"id": f"c{i}", "messages": msgs}
            else:
                rec = {"id": f"c{i}", "conversations": [
                    {"from": sharegpt[m["role"]], "value": m["content"]} for m in msgs]}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path
