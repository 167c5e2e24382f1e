"""Operators' verbs, never on a job's path: doctor, plan, bench, profile, timings report, top."""
