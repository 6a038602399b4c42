"""The trusted checks: the harness, each lab's checks and answer keys, lab 3's variants, speed tiers, re-measurement and review."""
