"""What crosses the store: the payload format, signatures, validation of learner answers."""
