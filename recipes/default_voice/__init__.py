"""Recipe that trains the default voice (speech LM + token decoder) from offline teachers."""
