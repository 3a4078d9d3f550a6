"""Judgement over records: statistics and the stopping rule's interval, comparing runs, history's steps,
seed verdicts, allocation sites and their diffs, derived step summaries and the memory/time frontier.
Reads `benchlib.records`; draws nothing (that is `benchlib.report`)."""
