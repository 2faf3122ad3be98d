"""Direct preference optimisation on the megatron engine (``mcore-rl dpo``): see :mod:`mcore_rl.dpo.trainer`
for the data flow. Losses are pure functions in :mod:`mcore_rl.algo.dpo`; preference data in
:mod:`mcore_rl.data.preference`; the schema is the ``dpo`` section of the run config."""
