"""The calibration pass: sampling from the model, objectives' signals, accumulated sums."""
