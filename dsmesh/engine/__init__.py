"""dsmesh's inference engine: LLMEngine (llm_engine.py), the facade over the model runner,
the scheduler, the input and output processors and the speculative worker; model/, kv/,
sched/, sampling/, runner/, speculative/ and ep/ hold the parts (docs/ENGINE.md)."""
