"""One server's tool calls on BFCL's non-live categories, judged by BFCL's own AST checker; prints JSON.

Runs in a virtual environment of its own that holds the `bfcl-eval` package (scripts/bench_tools.py makes it):

    bfcl-venv/bin/python scripts/bfcl_run.py --base http://127.0.0.1:PORT --model NAME --items simple_python=30 ...

Each item's question goes to the server's /v1/chat/completions with its functions as OpenAI tools (BFCL's own
conversion, as its function-calling handlers send them: dots in names become underscores), greedy. Per category:
how many answers made a call, how many of those were well-formed (every call names an offered tool, its arguments
validate against that tool's schema, and no call leaked into the text), how many BFCL's checker passes (for
irrelevance: answered without a call)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import types

import httpx
import jsonschema


def _bfcl():
    """BFCL's loaders, converter and checker. Its model table imports every vendor's SDK, of which the checker needs
    one fact: function-calling models send dotted names with underscores, as these requests do."""

    class _FunctionCalling:
        underscore_to_dot = True

    table = types.ModuleType("bfcl_eval.constants.model_config")
    table.MODEL_CONFIG_MAPPING = type("Table", (dict,), {"__getitem__": lambda self, key: _FunctionCalling()})()
    sys.modules["bfcl_eval.constants.model_config"] = table
    from bfcl_eval.constants.enums import Language, ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

    def tools(functions):
        return convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)

    return load_dataset_entry, load_ground_truth_entry, tools, ast_checker, Language


LEAK = re.compile(r'<tool_call>|\{\s*"name"\s*:')


def language(category: str, Language):
    if category.endswith("java"):
        return Language.JAVA
    return Language.JAVASCRIPT if category.endswith("javascript") else Language.PYTHON


def run_category(client: httpx.Client, model: str, category: str, count: int, bfcl) -> dict:
    load_items, load_answers, to_tools, ast_checker, Language = bfcl
    items = load_items(category, include_prereq=False)[:count]
    # The checker reads the functions as BFCL wrote them (Java and JavaScript types), the requests carry them as
    # its handlers send them (those types as strings, with a hint in the description).
    plain = {
        e["id"]: e["function"] for e in load_items(category, include_prereq=False, include_language_specific_hint=False)
    }
    answers = {a["id"]: a["ground_truth"] for a in load_answers(category)} if category != "irrelevance" else {}
    tally = {"items": len(items), "called": 0, "well_formed": 0, "passed": 0, "calls": 0}
    for item in items:
        offered = to_tools(item["function"])
        body = {
            "model": model,
            "messages": item["question"][0],
            "tools": offered,
            "temperature": 0,
            "max_tokens": 400,
            "seed": 0,
            **({"logprobs": True, "top_logprobs": 5} if "parallel" in category else {}),
        }
        reply = client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        message = reply.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        tally["calls"] += len(calls)
        if "parallel" in category:
            tally.setdefault("second_call_p", []).append(second_call_chance(reply.json()["choices"][0]))
        if calls:
            tally["called"] += 1
            tally["well_formed"] += well_formed(calls, offered, message.get("content") or "")
        if category == "irrelevance":
            tally["passed"] += not calls
            continue
        output = []
        for name, arguments in calls:
            try:
                output.append({name: json.loads(arguments)})
            except ValueError:
                output.append({name: {}})
        verdict = ast_checker(
            plain[item["id"]], output, answers[item["id"]], language(category, Language), category, "localllm-FC"
        )
        tally["passed"] += bool(verdict["valid"])
    return tally


SECOND_CALL = ("{", "[", ",", "<tool_call>")


def second_call_chance(choice: dict) -> float:
    """Where the answer's first call object closes, the chance the model gave the next token beginning another call
    (its top five alternatives): why a model makes one call where two were asked for, from its own logits."""
    tokens = (choice.get("logprobs") or {}).get("content") or []
    depth, began = 0, False
    for i, token in enumerate(tokens):
        for ch in token["token"]:
            depth += (ch == "{") - (ch == "}")
            began = began or ch == "{"
        if began and depth == 0:
            after = tokens[i + 1]["top_logprobs"] if i + 1 < len(tokens) else []
            chance = sum(math.exp(a["logprob"]) for a in after if a["token"].strip().startswith(SECOND_CALL))
            return round(chance, 4)
    return 0.0


def same_on_every_route(client: httpx.Client, model: str, category: str, count: int, bfcl) -> dict:
    """The same questions through /v1/chat/completions, Ollama's /api/chat and Anthropic's /v1/messages (tools in
    each API's shape): how many items got the same calls (names and arguments) on all three."""
    load_items, _, to_tools, _, _ = bfcl
    agree = 0
    items = load_items(category, include_prereq=False)[:count]
    for item in items:
        tools = to_tools(item["function"])
        messages = item["question"][0]
        openai = client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 400},
        ).json()["choices"][0]["message"]
        ollama = client.post(
            "/api/chat",
            json={"model": model, "messages": messages, "tools": tools, "stream": False, "options": _GREEDY},
        ).json()["message"]
        anthropic_tools = [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in tools
        ]
        anthropic = client.post(
            "/v1/messages",
            json={"model": model, "messages": messages, "tools": anthropic_tools, "temperature": 0, "max_tokens": 400},
        ).json()["content"]
        calls = [
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in openai.get("tool_calls") or []],
            [(c["function"]["name"], c["function"]["arguments"]) for c in ollama.get("tool_calls") or []],
            [(b["name"], b["input"]) for b in anthropic if b["type"] == "tool_use"],
        ]
        agree += calls[0] == calls[1] == calls[2]
    return {"items": len(items), "agree": agree}


_GREEDY = {"temperature": 0, "num_predict": 400}


def well_formed(calls: list[tuple[str, str]], offered: list[dict], content: str) -> bool:
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in offered}
    if LEAK.search(content):
        return False
    for name, arguments in calls:
        if name not in schemas:
            return False
        try:
            jsonschema.validate(json.loads(arguments), schemas[name])
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--items", nargs="+", required=True, help="category=count")
    parser.add_argument("--routes", help="category=count: also compare the calls on the three chat APIs")
    args = parser.parse_args()
    bfcl = _bfcl()
    results = {}
    with httpx.Client(base_url=args.base, timeout=600) as client:
        for spec in args.items:
            category, count = spec.split("=")
            results[category] = run_category(client, args.model, category, int(count), bfcl)
            print(category, results[category], file=sys.stderr, flush=True)
        if args.routes:
            category, count = args.routes.split("=")
            results["routes"] = same_on_every_route(client, args.model, category, int(count), bfcl)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
