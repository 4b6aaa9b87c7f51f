"""What a run turns into: masks (selection), masked training (masking), PEFT configs (peft_hints)."""
