"""Agentic RL: multi-turn, tool-calling rollouts (the ``rollout.multi_turn`` section).

    config.py       MultiTurnConfig (``rollout.multi_turn``): limits, tools, environment, parser
    tools.py        a tool: name + JSON schema of its arguments + a function returning text (+ a reward);
                    registered as ``module:function``, ``file.py:function`` or a YAML tool list
    environment.py  an environment that answers and rewards turns instead (step(conversation) -> observation,
                    reward, done), as NeMo-RL's
    executor.py     tool calls and environment steps in sandboxed worker processes (time limit, memory cap)
    chat.py         the tokenizer's chat template: tool-call parsing (Hermes ``<tool_call>{json}</tool_call>``,
                    pluggable) and the tool turn's tokens
    rollout.py      the multi-turn loop over a token-in/token-out engine, every sample in flight together
    records.py      conversations -> the position-aligned RolloutBatch with the model-token mask, and metrics

The package sits above ``data`` and ``scoring`` (it uses the tokenizer and the scorers' process pool) and
below ``config`` (which composes its section) and the ``trainer`` (which drives it). Importing this package
imports nothing heavy: ``config.py`` stays free of torch, as every config section.
"""
