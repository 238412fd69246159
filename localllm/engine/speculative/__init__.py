"""Speculative decoding: drafters that guess a request's next tokens cheaply, and the policy that sizes each guess.

Before every step the engine thread (engine/runner.py) asks each generating request's drafter for a draft; the
scheduler puts the draft rows into the same batch as the other slots' decode rows and prefill chunks; the engine
verifies them with the request's own sampler chain (the lossless rule is stated in ModelEngine._verify) and reports
how many were accepted. Rejected positions leave the target's KV there, and the drafter's own cache here.

    drafters.py     Drafter (per request: propose, feedback, close); NgramDrafter (prompt lookup: continue the latest
                    earlier occurrence of the text's ending); SourceDrafter over a DraftSource: a small model with
                    the same vocabulary (DraftModel) or the target's own MTP head (backends/llama_cpp/speculative.py)
    policy.py       StepCost (what a row costs) and DraftWindow (per request: how many draft tokens are worth
                    verifying this step)
    speculation.py  Speculation: per loaded model, builds each request's drafter from its spec_type
"""
