"""Real chat prompts cut to exact token lengths (block multiples and multiples +-1).

Each prompt is the model's chat template around a user message; the message is an instruction
followed by a passage, and the passage is cut token-wise so the whole prompt has the target
length. Prompts are given as token ids, as a client holding the template would send them.
"""

from __future__ import annotations

PASSAGES = [
    (
        "Explain in detail what the following passage says about the history of bread.",
        "Bread is one of the oldest prepared foods. Evidence from 30,000 years ago in Europe "
        "revealed starch residue on rocks used for pounding plants. It is possible that during "
        "this time, starch extract from the roots of plants, such as cattails and ferns, was "
        "spread on a flat rock, placed over a fire and cooked into a primitive form of flatbread. "
        "Around 10,000 BC, with the dawn of the Neolithic age and the spread of agriculture, "
        "grains became the mainstay of making bread.",
    ),
    (
        "Summarize the following text about the water cycle for a ten year old student.",
        "The water cycle describes how water evaporates from the surface of the earth, rises "
        "into the atmosphere, cools and condenses into clouds, and falls again to the surface "
        "as precipitation. The water falling on land collects in rivers and lakes, soil, and "
        "porous layers of rock, and much of it flows back into the oceans, where it will once "
        "more evaporate. The cycling of water in and out of the atmosphere is a significant "
        "aspect of the weather patterns on Earth.",
    ),
    (
        "Write a short story that begins with the following paragraph.",
        "The lighthouse keeper had not seen another person in forty days. Every evening he "
        "climbed the spiral stairs, polished the great lens, and lit the lamp that warned ships "
        "away from the rocks. On the forty-first evening, as the fog rolled in from the sea, he "
        "noticed a small boat drifting toward the shore with its sail torn and nobody at the "
        "helm. He put on his coat, took his lantern and walked down to the beach.",
    ),
    (
        "List the main ideas of the following paragraph about computer memory.",
        "Computer memory is organized in a hierarchy. Registers inside the processor are the "
        "fastest and smallest. Caches hold recently used data close to the cores. Main memory, "
        "made of DRAM, is much larger but slower, and storage devices such as solid state drives "
        "keep data when the power is off. Programs run faster when the data they need is found "
        "in the upper levels of the hierarchy, which is why locality of reference matters.",
    ),
    (
        "Give advice to a beginner based on the following notes about learning to cook.",
        "Start with simple recipes that use few ingredients. Learn to hold a knife properly and "
        "practice cutting onions, carrots and potatoes into even pieces. Taste your food while "
        "you cook and add salt a little at a time. Keep your work area clean and read the whole "
        "recipe before you begin. Do not be afraid of mistakes; every cook burns a pan of rice "
        "at some point and learns to watch the heat more carefully next time.",
    ),
    (
        "Explain the following description of photosynthesis in your own words.",
        "Photosynthesis is the process used by plants, algae and some bacteria to convert light "
        "energy into chemical energy. Using sunlight, water and carbon dioxide, these organisms "
        "produce glucose and release oxygen as a by-product. The process takes place mainly in "
        "the chloroplasts of leaf cells, which contain the green pigment chlorophyll that "
        "absorbs red and blue light and reflects green light.",
    ),
    (
        "Describe the city in the following travel note and suggest what to visit.",
        "The old town sits on a hill above the river, with narrow streets of stone houses, a "
        "cathedral with a tall bell tower and a market square where farmers sell cheese, honey "
        "and fruit every Saturday. In the evening the bridges are lit and people walk along the "
        "river banks. A short train ride away there are vineyards, a lake for swimming in the "
        "summer and hiking trails through the forest.",
    ),
    (
        "Explain why the following habits help people sleep better.",
        "Go to bed and wake up at the same time every day, even on weekends. Keep the bedroom "
        "dark, quiet and cool. Avoid large meals, caffeine and alcohol before bedtime. Get some "
        "exercise during the day and spend time outside in natural light. Turn off screens an "
        "hour before sleep and use that time to read a book or take a warm bath instead.",
    ),
    (
        "Write a friendly email to a colleague based on the following points.",
        "The project meeting moves from Tuesday to Thursday at ten in the morning. Please bring "
        "the latest version of the budget spreadsheet and the list of open questions from the "
        "client. The new designer joins the team next week and will sit near the window. Lunch "
        "after the meeting is at the small Italian place around the corner.",
    ),
    (
        "Explain the main argument of the following passage about exercise.",
        "Regular physical activity improves health in many ways. It strengthens the heart and "
        "lungs, helps control weight, builds muscle and bone, and lowers the risk of diabetes "
        "and some cancers. Exercise also improves mood and sleep, and even short walks during "
        "the day add up. Experts recommend at least one hundred and fifty minutes of moderate "
        "activity each week for adults.",
    ),
]

# Block size 16: multiples of the block size and multiples +-1, plus a few others.
TARGET_LENGTHS = [127, 128, 129, 63, 64, 65, 95, 96, 97, 111]


def chat_prompt_ids(tokenizer, instruction: str, passage: str, length: int) -> list[int]:
    """Token ids of the chat-templated user message "instruction\\n\\npassage", with the
    passage cut so the whole prompt has exactly `length` tokens.

    Raises:
        ValueError: the passage is too short or the template too long for `length`.
    """
    sentinel = "\x00SENTINEL\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": sentinel}], tokenize=False, add_generation_prompt=True
    )
    head, tail = rendered.split(sentinel)
    head_ids = tokenizer.encode(head + instruction + "\n\n", add_special_tokens=False)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    body = tokenizer.encode(passage, add_special_tokens=False)
    keep = length - len(head_ids) - len(tail_ids)
    if keep < 1 or keep > len(body):
        raise ValueError(f"cannot build a {length}-token prompt from this passage")
    return head_ids + body[:keep] + tail_ids


def parity_prompts(tokenizer) -> list[list[int]]:
    """One prompt per target length, each from a different passage."""
    return [
        chat_prompt_ids(tokenizer, instr, passage, n)
        for (instr, passage), n in zip(PASSAGES, TARGET_LENGTHS)
    ]
