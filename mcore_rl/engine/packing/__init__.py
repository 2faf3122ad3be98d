"""How micro-batches are cut and laid out for the model: token budgets and balancing (``token_batching``),
packed rows and shared prompts (``shared_prefix``), fixed-size and budgeted micro-batches (``micro_batches``)."""
