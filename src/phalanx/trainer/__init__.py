"""The Trainer: Hugging Face's Trainer shape (TrainingArguments, callbacks, trainer_state.json) on every phalanx
strategy, as a client of the Engine only."""
