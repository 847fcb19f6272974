"""fusionlab in a model: capture its norm calls, patch in the winners, prove the gain end to end."""
