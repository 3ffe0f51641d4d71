"""Training data: the corpus (`corpus`: file listing, train/val split, tokenizer
training, token cache), token streams cut into training rows (`packing`), code-completion
prompts cut from source files (`code_prompts`), chat conversations and their masks
(`chat`), and the data set of the target's regenerated continuations for drafter
training (`regenerate`: its prompts, splits and files; the target runs over them in
`specjax.tools.regenerate`, `python -m specjax.regenerate`). Nothing here imports
`specjax.decoding`."""
