"""Write the small, original sample data of the RoleLLM / out-of-distribution evaluations.

    .venv/bin/python scripts/make_suite_samples.py            # rewrite the files
    .venv/bin/python scripts/make_suite_samples.py --check    # exit 1 if they are stale

Every sentence here was written for rolemrc (invented roles, our own questions and answers);
nothing is copied from RoleBench, CharacterLLM, RoleEval or any benchmark. Only the *layouts*
(folder names, file names, field names) follow the public releases, so the readers that take
the real files are the ones the samples exercise.

Outputs under ``src/rolemrc/assets/``:

    sample/rolebench/                         RoleBench's public layout
        profiles-eng/desc.json                {role: description}
        profiles-zh/desc.json
        profiles-eng/roles.jsonl              ours: {name, description, catchphrases, dialogue}
        profiles-zh/roles.jsonl
        profiles-eng/roles_with_scripts.jsonl ours: the same roles + script_file, Context-Instruct's input
        profiles-eng/scripts/<Name>.txt       a short original scene script per role
        rolebench-eng/instruction-generalization/{general,role_specific}/{train,test}.jsonl
        rolebench-eng/role-generalization/{general,role_specific}/{train,test}.jsonl
        rolebench-zh/{general,role_specific}/{train,test}.jsonl
                                              rows {"role", "question", "generated": [answers]}
        instructions-eng/instructions-general.jsonl   RAW: {"question", "answer"} (original answers)
        instructions-zh/instructions-general.jsonl
    sample/characterllm/                      CharacterLLM's public layout
        profiles/wiki_<Name>.txt              free-text profile
        questions/generated_agent_interview_<Name>.json               [{topic_id, topic, question}]
        questions/generated_agent_interview_for_multiturn_<Name>.json
    lm_eval/general_sample.{yaml,jsonl}       a tiny general multiple-choice task
    lm_eval/roleeval_sample.{yaml,jsonl}      RoleEval-style role-knowledge multiple choice
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "rolemrc" / "assets"

# ---------------------------------------------------------------- RoleBench-shaped rows

ENG_ROLES = {
    # instruction generalization: the same roles in train and test, new instructions in test
    "Tobias Wren": dict(
        description="The keeper of the Gullrock Light, who has tended its lamp for thirty-one years and logged "
                    "every storm in a leather book.",
        catchphrases=["Aye, shipmate", "Mind the tide"],
        dialogue=[{"user": "Do you ever get lonely out there?",
                   "assistant": "Aye, shipmate, now and then. But the gulls talk back, and the lamp never sulks."}],
    ),
    "Colette Marchand": dict(
        description="Head pastry chef of Le Petit Fouet, a small bakery in Lyon, who shapes every croissant by hand.",
        catchphrases=["mon ami", "Voila!"],
        dialogue=[{"user": "What is the secret of a good croissant?",
                   "assistant": "Cold butter, warm hands used quickly, and patience, mon ami. Voila!"}],
    ),
    # role generalization: roles seen only in test
    "Maren Holt": dict(
        description="Chief engineer of the freighter Long Haul, who keeps forty-year-old reactors running with "
                    "spare parts and stubbornness.",
        catchphrases=["Hold together, old girl", "by the numbers"],
        dialogue=[],
    ),
}
ZH_ROLES = {
    "林掌柜": dict(
        description="江南小镇一家老茶馆的掌柜，泡了四十年的茶，认得镇上每一位老茶客。",
        catchphrases=["客官请坐", "茶要慢慢喝"],
        dialogue=[{"user": "今天喝什么茶好？", "assistant": "客官请坐，今儿下雨，来一壶红茶暖暖身子。茶要慢慢喝。"}],
    ),
    "苏绣娘": dict(
        description="苏州的一位刺绣师傅，十二岁学艺，一根针能劈成十六股丝。",
        catchphrases=["针脚要细", "心静手才稳"],
        dialogue=[],
    ),
}

# Short scene scripts of the English roles (Context-Instruct's input: the role knowledge it
# turns into question-answer pairs). Paragraphs are blank-line separated, so segments cut there.
ENG_SCRIPTS = {
    "Tobias Wren": [
        "INT. GULLROCK LIGHT, LAMP ROOM - DUSK. Wind against the glass. TOBIAS WREN, sixty, oilskin coat, "
        "climbs the last of the ninety-four steps and trims the wick.",
        "TOBIAS: Thirty-one years I have lit you, old girl, and not one night missed. Mind the tide.",
        "He opens a leather log book on the chart table. Page after page of storms in a small, careful hand.",
        "TOBIAS (writing): Wind north-east, force seven. Rain from the south by midnight. Supply boat late again.",
        "INT. GULLROCK LIGHT, KITCHEN - MORNING. Tobias polishes the great lens with a chamois cloth before he "
        "boils the kettle. A gull taps at the window.",
        "TOBIAS: Aye, shipmate, you will have your crust. The lens comes first, then the tea, then the gulls.",
        "EXT. GULLROCK LANDING - DAY. A rowing boat bumps the stone steps. The harbour master, ELSIE DUNN, "
        "hands up a sack of flour and a bundle of letters.",
        "ELSIE: They say the light will be automatic in a year, Tobias.",
        "TOBIAS: Then the light will not know when a fishing boat is in trouble. I do. Mind the tide going back, Elsie.",
    ],
    "Colette Marchand": [
        "INT. LE PETIT FOUET, LYON - 4 A.M. Flour in the air. COLETTE MARCHAND, forties, sleeves rolled, folds a "
        "slab of cold butter into the dough on a marble counter.",
        "COLETTE: Three folds, mon ami, and never warm hands. The butter must stay a sheet, not a puddle.",
        "Her apprentice, THEO, reaches for the dough sheeter in the corner. Colette shakes her head.",
        "COLETTE: The machine is for the tourists' baguettes. Every croissant here is shaped by hand. Voila!",
        "INT. LE PETIT FOUET, SHOP FRONT - 7 A.M. The first customers queue along the street by the river. The "
        "sign above the door shows a little whisk.",
        "THEO: Why is the bakery called the little whisk?",
        "COLETTE: My grandmother's first tool was a whisk she bought with her first week's wages. She opened "
        "this shop with it. Voila, the name.",
    ],
    "Maren Holt": [
        "INT. FREIGHTER LONG HAUL, ENGINE DECK - SHIP'S NIGHT. Red warning lights. MAREN HOLT, chief engineer, "
        "grease to the elbows, wedges a spanner into a coolant valve.",
        "MAREN: Hold together, old girl. Forty years old and you still fly better than the new ones.",
        "The CAPTAIN's voice crackles on the intercom: how long until the second reactor is back?",
        "MAREN: By the numbers, Captain: coolant loop in ten minutes, pressure in twenty, full power in an hour. "
        "Unless you want it faster and louder.",
        "INT. LONG HAUL, STORES LOCKER - LATER. Shelves of salvaged parts, each tagged in Maren's handwriting "
        "with the ship it came from.",
        "MAREN: Spare parts and stubbornness. Mostly stubbornness. The parts run out first.",
    ],
}


def script_file(name: str) -> str:
    return f"scripts/{name.replace(' ', '_')}.txt"


# General instructions: (question, original answer, {role: role-customised answer}).
ENG_GENERAL = [
    ("Give three tips for staying healthy.",
     "Eat a balanced diet, exercise regularly and get enough sleep.",
     {"Tobias Wren": "Aye, shipmate: eat your fish, climb the stairs twice a day and sleep when the lamp allows. "
                     "Mind the tide.",
      "Colette Marchand": "Mon ami, eat good bread not too much butter, walk to the market and sleep before the "
                          "ovens wake. Voila!",
      "Maren Holt": "By the numbers: eat real food, move every shift and sleep eight hours. Hold together, old girl."}),
    ("Explain what a noun is.",
     "A noun is a word that names a person, place, thing or idea.",
     {"Tobias Wren": "Aye, a noun names a thing, shipmate, like lamp, rock or storm. Mind the tide.",
      "Colette Marchand": "A noun, mon ami, is the name of a thing: flour, oven, croissant. Voila!",
      "Maren Holt": "A noun names a thing. Reactor. Valve. Wrench. By the numbers."}),
    ("Suggest a name for a small cafe.",
     "The Corner Cup.",
     {"Tobias Wren": "Aye, call it The Lamp Room, shipmate, warm and bright. Mind the tide.",
      "Colette Marchand": "Le Petit Matin, mon ami, for the morning coffee. Voila!",
      "Maren Holt": "Coolant Break. Everybody understands that. Hold together, old girl."}),
    ("Describe the color blue to someone who cannot see.",
     "Blue feels like cool water on your skin or a calm breeze.",
     {"Tobias Wren": "Blue is the cold of the sea on your hands at dawn, shipmate. Mind the tide.",
      "Colette Marchand": "Blue is the cool of marble where I roll the dough, mon ami. Voila!",
      "Maren Holt": "Blue is the hum of a reactor running cool and steady. By the numbers."}),
]
ENG_SPECIFIC = {
    "Tobias Wren": [
        ("How long have you kept the Gullrock Light?",
         "Aye, thirty-one years, shipmate, every night of them. Mind the tide."),
        ("Where do you write down the storms?",
         "In my leather log book, shipmate, every gale since the first. Mind the tide."),
        ("What do you clean first each morning?",
         "The lens, shipmate, before tea and before the gulls. Mind the tide."),
    ],
    "Colette Marchand": [
        ("Which city is your bakery in?", "Lyon, mon ami, on a little street by the river. Voila!"),
        ("What do you shape by hand?", "Every croissant, mon ami, not one by machine. Voila!"),
        ("What is your bakery called?", "Le Petit Fouet, mon ami, the little whisk. Voila!"),
    ],
    "Maren Holt": [
        ("What ship do you work on?", "The freighter Long Haul. Forty years old and still flying. By the numbers."),
        ("How old are your reactors?", "Forty years, and I keep them running. Hold together, old girl."),
        ("What keeps the engines running?", "Spare parts and stubbornness. Mostly stubbornness. By the numbers."),
    ],
}
ZH_GENERAL = [
    ("请给出三个保持健康的建议。", "均衡饮食，规律运动，保证睡眠。",
     {"林掌柜": "客官请坐，少吃油腻，多走几步路，早些歇息。茶要慢慢喝。",
      "苏绣娘": "饭要按时吃，人要常走动，夜里早睡。心静手才稳。"}),
    ("什么是名词？", "名词是表示人、地点、事物或概念的词。",
     {"林掌柜": "名词嘛，就是东西的名字，像茶壶、茶碗、茶叶。茶要慢慢喝。",
      "苏绣娘": "名词就是东西的名字，比如针、线、绸缎。针脚要细。"}),
    ("给一家小书店起个名字。", "拐角书屋。",
     {"林掌柜": "就叫‘慢读斋’吧，和喝茶一个道理。茶要慢慢喝。",
      "苏绣娘": "叫‘一线书房’，一针一线，一字一句。心静手才稳。"}),
]
ZH_SPECIFIC = {
    "林掌柜": [("你泡了多少年的茶？", "客官请坐，整整四十年了。茶要慢慢喝。"),
              ("你的茶馆在哪里？", "在江南的一个小镇上，河边第三家。茶要慢慢喝。")],
    "苏绣娘": [("你几岁开始学刺绣？", "十二岁就拜师学艺了。心静手才稳。"),
              ("一根针能劈成几股丝？", "能劈成十六股，针脚要细。")],
}
# Which questions are test and which train (the rest): index sets per list.
TEST_GENERAL_ENG, TEST_GENERAL_ZH = {2, 3}, {2}
INST_ROLES, ROLE_GEN_ROLES = ["Tobias Wren", "Colette Marchand"], ["Maren Holt"]


def rb_row(role: str, question: str, answer: str) -> dict:
    return {"role": role, "question": question, "generated": [answer]}


def rolebench_files() -> dict[str, object]:
    out: dict[str, object] = {}
    root = "sample/rolebench/"
    out[root + "profiles-eng/desc.json"] = {n: r["description"] for n, r in ENG_ROLES.items()}
    out[root + "profiles-zh/desc.json"] = {n: r["description"] for n, r in ZH_ROLES.items()}
    out[root + "profiles-eng/roles.jsonl"] = [{"name": n, **r} for n, r in ENG_ROLES.items()]
    out[root + "profiles-zh/roles.jsonl"] = [{"name": n, **r} for n, r in ZH_ROLES.items()]
    # Context-Instruct's input: python synthesize.py stages=[context_instruct] context_instruct.roles=<this>
    out[root + "profiles-eng/roles_with_scripts.jsonl"] = [{"name": n, **r, "script_file": script_file(n)}
                                                           for n, r in ENG_ROLES.items()]
    for n, paragraphs in ENG_SCRIPTS.items():
        out[root + "profiles-eng/" + script_file(n)] = "\n\n".join(paragraphs) + "\n"
    out[root + "instructions-eng/instructions-general.jsonl"] = [{"question": q, "answer": a} for q, a, _ in ENG_GENERAL]
    out[root + "instructions-zh/instructions-general.jsonl"] = [{"question": q, "answer": a} for q, a, _ in ZH_GENERAL]

    def split(general, specific, roles, test_general, prefix):
        gen_train, gen_test, spe_train, spe_test = [], [], [], []
        for i, (q, _, custom) in enumerate(general):
            for role in roles:
                (gen_test if i in test_general else gen_train).append(rb_row(role, q, custom[role]))
        for role in roles:
            qa = specific[role]
            spe_train += [rb_row(role, q, a) for q, a in qa[:-1]]
            spe_test += [rb_row(role, q, a) for q, a in qa[-1:]]
        out[prefix + "general/train.jsonl"] = gen_train
        out[prefix + "general/test.jsonl"] = gen_test
        out[prefix + "role_specific/train.jsonl"] = spe_train
        out[prefix + "role_specific/test.jsonl"] = spe_test

    split(ENG_GENERAL, ENG_SPECIFIC, INST_ROLES, TEST_GENERAL_ENG, root + "rolebench-eng/instruction-generalization/")
    # role generalization: train on the instruction-generalization roles, test on unseen ones
    pre = root + "rolebench-eng/role-generalization/"
    out[pre + "general/train.jsonl"] = [rb_row(r, q, c[r]) for q, _, c in ENG_GENERAL for r in INST_ROLES]
    out[pre + "general/test.jsonl"] = [rb_row(r, q, c[r]) for q, _, c in ENG_GENERAL for r in ROLE_GEN_ROLES]
    out[pre + "role_specific/train.jsonl"] = [rb_row(r, q, a) for r in INST_ROLES for q, a in ENG_SPECIFIC[r]]
    out[pre + "role_specific/test.jsonl"] = [rb_row(r, q, a) for r in ROLE_GEN_ROLES for q, a in ENG_SPECIFIC[r]]
    split(ZH_GENERAL, ZH_SPECIFIC, list(ZH_ROLES), TEST_GENERAL_ZH, root + "rolebench-zh/")
    return out


# ---------------------------------------------------------------- CharacterLLM-shaped files

CHARACTERS = {
    "Halvard": ("Halvard Stone was a clockmaker in the mountain town of Brenn in the 1880s. He built the town "
                "hall clock, repaired watches for the railway, and never left Brenn except once, to see the sea. "
                "He was patient, exact and dry in humour, and he distrusted anything that could not be mended."),
    "Ottilie": ("Ottilie Varga was a balloonist who crossed the Carpathians in 1906 in a hydrogen balloon named "
                "Kestrel. She kept weather notes in green ink, spoke four languages badly and loudly, and believed "
                "that every map was a rumour until she had flown over it."),
}
TOPICS = [("topic-1", "personal information and past experiences"), ("topic-2", "interpersonal relationships"),
          ("topic-3", "values and preferences"), ("topic-4", "difficult to answer without breaking character")]
SINGLE_Q = {
    "Halvard": ["Tell me about yourself.", "What is the finest clock you ever built?",
                "Who did you work for besides the town?", "What do you value most in a craftsman?",
                "Which smartphone do you use?"],
    "Ottilie": ["Tell me about yourself.", "What was the name of your balloon?",
                "Who taught you to fly?", "Why do you distrust maps?", "Can you help me debug my JavaScript?"],
}
MULTI_Q = {
    "Halvard": ["Where did you grow up?", "Did you ever travel far from home?", "What did you think of the sea?",
                "Would you go back?", "What would you tell a young apprentice?", "How do you mend a stopped clock?"],
    "Ottilie": ["How did your crossing of the mountains begin?", "What did the weather do on the second day?",
                "Were you afraid?", "Who met you when you landed?", "Would you fly it again?",
                "What did you write in green ink?"],
}


def characterllm_files() -> dict[str, object]:
    out: dict[str, object] = {}
    root = "sample/characterllm/"
    for name, text in CHARACTERS.items():
        out[root + f"profiles/wiki_{name}.txt"] = text + "\n"
        topics = [TOPICS[0], TOPICS[0], TOPICS[1], TOPICS[2], TOPICS[3]]
        single = [{"topic_id": t, "topic": topic, "question": q} for (t, topic), q in zip(topics, SINGLE_Q[name])]
        out[root + f"questions/generated_agent_interview_{name}.json"] = single
        out[root + f"questions/generated_agent_interview_for_multiturn_{name}.json"] = [
            {"topic_id": TOPICS[0][0], "topic": TOPICS[0][1], "question": q} for q in MULTI_Q[name]
        ]
    return out


# ---------------------------------------------------------------- lm-evaluation-harness tasks

GENERAL_MC = [
    ("How many days are in a week?", ["five", "seven", "ten"], 1),
    ("Which of these is a colour?", ["green", "seven", "quickly"], 0),
    ("What do bees make?", ["milk", "silk", "honey"], 2),
    ("Which animal can fly?", ["a fish", "a sparrow", "a horse"], 1),
    ("What is frozen water called?", ["ice", "steam", "sand"], 0),
    ("Which is the largest?", ["a mouse", "a cat", "an elephant"], 2),
]
ROLEEVAL_MC = [
    ("Tobias Wren", "How many years has Tobias Wren kept the Gullrock Light?",
     ["eleven", "thirty-one", "fifty", "three"], 1),
    ("Tobias Wren", "Where does Tobias Wren record the storms?",
     ["on the lighthouse wall", "in a leather log book", "in letters to his sister", "nowhere"], 1),
    ("Colette Marchand", "In which city is Le Petit Fouet?", ["Paris", "Marseille", "Lyon", "Nice"], 2),
    ("Colette Marchand", "What does Colette Marchand shape by hand?",
     ["baguettes", "croissants", "macarons", "wedding cakes"], 1),
    ("Maren Holt", "What is the name of Maren Holt's ship?", ["Long Haul", "Kestrel", "Gullrock", "Brenn"], 0),
    ("Maren Holt", "How old are the reactors Maren Holt maintains?", ["four", "ten", "forty", "a hundred"], 2),
]
GENERAL_YAML = """# A tiny general multiple-choice task shipped by rolemrc (log-likelihood accuracy over the options).
# benchmarks=general_sample runs it offline on any model; data_files are relative to this file.
task: rolemrc_general_sample
dataset_path: json
dataset_kwargs:
  data_files:
    test: general_sample.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
ROLEEVAL_YAML = """# RoleEval-style role-knowledge multiple choice as an lm-evaluation-harness task: each row is
# {role, question, choices: [str], answer: index}; the score is log-likelihood accuracy over the
# options (acc) and its length-normalised twin (acc_norm). Any MC role benchmark in this shape runs
# through the same path: copy this file and point data_files at its JSONL (relative paths are
# resolved against the YAML's folder by rolemrc).
task: rolemrc_roleeval_sample
dataset_path: json
dataset_kwargs:
  data_files:
    test: roleeval_sample.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "A question about {{role}}.\\nQuestion: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def lm_eval_files() -> dict[str, object]:
    return {
        "lm_eval/general_sample.yaml": GENERAL_YAML,
        "lm_eval/general_sample.jsonl": [{"question": q, "choices": c, "answer": a} for q, c, a in GENERAL_MC],
        "lm_eval/roleeval_sample.yaml": ROLEEVAL_YAML,
        "lm_eval/roleeval_sample.jsonl": [{"role": r, "question": q, "choices": c, "answer": a}
                                          for r, q, c, a in ROLEEVAL_MC],
    }


def render(name: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if name.endswith(".jsonl"):
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in content)  # type: ignore[union-attr]
    return json.dumps(content, ensure_ascii=False, indent=2) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the files differ")
    args = ap.parse_args()
    files = {**rolebench_files(), **characterllm_files(), **lm_eval_files()}
    stale = []
    for name, content in sorted(files.items()):
        path, text = ASSETS / name, render(name, content)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if stale:
        print("stale: " + ", ".join(stale), file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'wrote'} {len(files)} files under {ASSETS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
