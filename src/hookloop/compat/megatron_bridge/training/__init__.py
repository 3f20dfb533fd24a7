"""Training side of the Megatron-Bridge dialect: callbacks, state, entry points, forward step."""
