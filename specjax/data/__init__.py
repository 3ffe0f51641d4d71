"""Training data: the corpus (`corpus`: file listing, train/val split, tokenizer
training, token cache), token streams cut into training rows (`packing`), and the
target's regenerated greedy continuations for drafter training (`regenerate`, run as
`python -m specjax.regenerate`)."""
