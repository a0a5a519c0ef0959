"""The syncer: reads learner answers, merges them per fragment, publishes new global versions."""
