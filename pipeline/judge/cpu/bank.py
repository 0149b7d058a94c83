"""A generated bank of labelled user replies, the larger part of what the ``embedding`` judge learns from.

The hand-written examples (``pipeline/judge/data/examples.jsonl``) are short and few; a head fitted
on them alone learns their wording. This module composes many more replies, deterministically,
from parts written for it (our own wording): what the user reports (the answer worked, it failed,
it was corrected, nothing is known yet), in five domains (coding, writing, maths, support,
casual), with openers, closers, contrasts ("thanks, but ..."), irony, taste nits under a success,
follow-up questions after a success, deferrals, acknowledgements, topic changes, in English and
twelve other languages, short and long.

Labels follow the judge's guidelines (``docs/judge.md``): +1 the reply shows the turn was good
(confirms, uses, thanks for the content; a success with a matter-of-taste nit), -1 it was bad
(fails, corrects, repeats an ignored request, irony about it; "thanks, but" + a failure), 0 it
does not tell (questions, deferrals, bare acknowledgements, small talk, topic changes).

:func:`generated_examples` returns rows ``{"text", "label", "role": "user", "source": "bank"}``;
the same seed gives the same rows.
"""

from __future__ import annotations

import random

# -- English parts, by domain: {thing} is what the assistant produced -----------------------------------
THINGS = {
    "coding": ["the script", "your query", "the regex", "that function", "the Dockerfile", "the migration",
               "the patch", "the one-liner", "the config change", "the fix", "the new test", "the loop",
               "the SQL", "the cron entry", "the CSS change", "your snippet", "the type hints", "the makefile"],
    "writing": ["the email", "the cover letter", "the intro", "the tagline", "the toast", "the blurb",
                "the abstract", "the poem", "the summary", "the post", "the slide text", "the apology",
                "the bio", "the newsletter", "the caption", "the speech", "the rewrite", "the outline"],
    "maths": ["the derivative", "the proof", "the probability", "your answer", "the integral", "the percentage",
              "the conversion", "the estimate", "the determinant", "the sum", "the limit", "the solution",
              "the calculation", "the formula", "the mean", "the factorisation"],
    "support": ["the reset steps", "the refund request", "the router steps", "the printer setting", "the login fix",
                "the invoice", "the password reset", "the instructions", "the workaround", "the settings change",
                "the app reinstall", "the cancellation", "the address change", "the driver update"],
    "casual": ["the recipe", "the itinerary", "the gift idea", "the playlist", "the workout plan", "the movie pick",
               "the joke", "the book list", "the packing list", "the name idea", "the game suggestion",
               "the plant advice", "the menu", "the hike route"],
}

SUCCESS = {
    "coding": ["the tests pass now", "it compiles without a single warning", "the build is green again",
               "no more stack traces", "deployed it and the endpoint answers fine", "it runs in two seconds now",
               "the pipeline went through", "the error is gone", "it parsed all 40k rows", "CI is happy",
               "the page renders correctly now", "the memory usage dropped a lot", "merged it",
               "the container starts up cleanly", "the output matches what I expected",
               "that fixed the race condition", "lint passes", "it picks up the env var now"],
    "writing": ["sent it, and my manager replied within minutes", "posted it as is", "my editor loved it",
                "it reads so much better", "the tone is exactly right", "I printed it for the card",
                "submitted it this morning", "the client signed off on it", "everyone at the dinner laughed",
                "it fits the word limit perfectly", "I'm using it word for word", "it sounds like me now",
                "the team said it was the clearest update so far", "got two replies already"],
    "maths": ["that matches the answer key", "I got the same number by hand", "my teacher marked it correct",
              "it matches the back of the book", "checked it in a calculator, same result",
              "the units work out", "now I understand why the sign flips", "the proof makes sense now",
              "the homework checker accepted it", "it agrees with my simulation", "I finally get the chain rule",
              "the numbers add up"],
    "support": ["the money is back in my account", "I can log in again", "the printer works", "the package arrived",
                "the wifi is stable now", "the reset email came through", "the charge was reversed",
                "my account is unlocked", "the app opens again", "the sound is back", "the sync works",
                "the update installed fine", "the cancellation went through"],
    "casual": ["we made it tonight and everyone loved it", "the kids had a blast", "booked it",
               "used it at the party, big laughs", "my mum loved the gift", "the route was gorgeous",
               "the plant looks healthier already", "we watched it and it was great", "I slept well for once",
               "we followed the plan and saw everything", "the cake turned out perfect", "the team loved the name"],
}

FAILURE = {
    "coding": ["still getting the same error", "it throws a KeyError on line 12", "the build fails with your change",
               "now it's slower than before", "half the tests fail now", "it crashes as soon as it starts",
               "nothing happens when I run it", "the output is empty", "that function doesn't exist in this version",
               "it deleted the wrong rows", "the regex matches everything", "it returns None every time",
               "the migration broke the foreign keys", "it won't even compile", "the import fails",
               "same traceback as before", "it loops forever", "the query times out now"],
    "writing": ["that's way too formal for a friend", "I said under 100 words and this is three times that",
                "you changed the meaning of the second sentence", "it doesn't rhyme at all",
                "this sounds like a robot wrote it", "you dropped the part about the deadline",
                "the names are wrong", "it's in the wrong language", "it's full of clichés",
                "that's not the tone I asked for", "you left out the date", "it reads like an ad",
                "this is way too long", "it's still too stiff"],
    "maths": ["that's not right, the answer should be 12", "you forgot to carry the 2", "the sign is wrong",
              "my textbook says 0.25", "you divided instead of multiplying",
               "that's the formula for area, not perimeter",
              "the units don't match", "step three doesn't follow", "you dropped the constant",
              "the probability is bigger than 1", "that's the wrong derivative", "the total is off by 100"],
    "support": ["the link has expired, same as before", "I already tried restarting it", "still no refund",
                "that menu doesn't exist in my version", "the code you gave me is invalid", "it still won't connect",
                "the option is greyed out", "I was charged twice now", "it says my account doesn't exist",
                "the steps didn't change anything", "the printer is still offline", "still locked out"],
    "casual": ["that place closed years ago", "I said vegetarian", "that's a horror film, I asked for a comedy",
               "the cake burned at that temperature", "half of those aren't even in Lisbon", "the kids hated it",
               "that trail is closed in winter", "it's way over the budget I gave you", "the joke fell flat",
               "the plant died", "those flights don't exist", "you suggested the same book twice"],
}

CORRECTIONS = ["no, I meant {x}", "I asked for {x}, not {y}", "wrong one, I need {x}", "that's {y}, I wanted {x}",
               "not {y}. {x}", "read my message again, I said {x}", "it should be {x}", "I said {x}",
               "{x}, not {y}", "that's not what I asked, I want {x}", "you used {y} again instead of {x}",
               "again: {x}", "for the third time, {x}", "I already told you it's {x}", "nope, {x}"]
PAIRS = [("Python", "JavaScript"), ("the second file", "the first one"), ("Celsius", "Fahrenheit"),
         ("metres", "feet"), ("the 2023 figures", "the 2022 ones"), ("a haiku", "a limerick"),
         ("Postgres", "MySQL"), ("the mobile layout", "the desktop one"), ("plain text", "markdown"),
         ("French", "Spanish"), ("a table", "a list"), ("the median", "the mean"), ("Tuesday", "Thursday"),
         ("four people", "two"), ("the staging server", "production"), ("British spelling", "American"),
         ("bash", "zsh"), ("the invoice from March", "the February one"), ("under 50 words", "a long version"),
         ("the vegan option", "a meat dish"), ("a window seat", "an aisle seat"), ("radians", "degrees")]

NEUTRAL = {
    "question": ["how would I do it for {v}?", "what does {t} mean here?", "can you also {e}?",
                 "does this work on {p}?", "why does it use {t}?", "could you explain the second step?",
                 "what happens if the input is empty?", "is there a faster way?", "which version do I need?",
                 "where do I put that?", "can it handle {v} too?", "what's the difference between {t} and {t2}?",
                 "and if I want {v} instead?", "how long does that usually take?", "is that safe to run on {p}?"],
    "defer": ["I'll try it tonight", "will test tomorrow and let you know", "haven't run it yet",
              "going to check with my team first", "let me look at it after lunch", "I'll read it properly later",
              "saving this for the weekend", "will try it when I'm back at my desk", "not sure yet, need to test",
              "I'll report back", "need to run it on the real data first", "let me think about it"],
    "ack": ["okay", "noted", "I see", "alright", "sure", "right", "oh", "fine, noted",
            "hm ok", "understood", "got it", "ah", "heh", "interesting"],
    "topic": ["unrelated, but {q}", "different question: {q}", "by the way, {q}", "new topic. {q}",
              "quick one: {q}", "switching gears, {q}", "also, {q}"],
    "smalltalk": ["it's raining here all day", "I'm so tired today", "what's your favourite film?",
                  "haha you're funny", "brb, coffee", "my cat just walked across the keyboard",
                  "long day at work", "do you ever sleep?", "it's my birthday tomorrow", "good morning!",
                  "sorry, someone's at the door", "wait, hold on", "one sec, my meeting started",
                  "never mind, I'll come back to this", "hang on, my boss is calling"],
    "info": ["it's Python 3.11 on Ubuntu", "we use Postgres 15", "the file is about 2 GB", "I'm on a Mac",
             "it's for my sister's wedding", "the class is intro calculus", "my plan is the basic one",
             "we're four adults and two kids", "the budget is about 500 euros", "the deadline is Friday",
             "it runs on a Raspberry Pi", "the audience is mostly engineers"],
}
FILL = {"v": ["dictionaries", "negative numbers", "a CSV file", "two columns", "a list of dates", "the plural form",
              "a bigger group", "leap years", "unicode names", "a second account"],
        "t": ["the lambda", "the modulo", "that flag", "the comma", "the log", "the offset", "that keyword",
              "the semicolon", "the kwarg", "the chain rule"],
        "t2": ["a loop", "a generator", "the other flag", "division", "a dict"],
        "e": ["add comments", "make a shorter version", "do the same for June", "write a test for it",
              "translate it to German", "add a title", "show the steps"],
        "p": ["Windows", "an old iPhone", "Python 3.8", "ARM", "Firefox", "a shared server"],
        "q": ["what's a good name for a cat?", "how do I boil an egg?", "is Rust hard to learn?",
              "what's the capital of Peru?", "any tips for sleeping better?", "how does compound interest work?"]}

OPEN_POS = ["", "", "", "thanks! ", "thank you, ", "great, ", "perfect, ", "yes! ", "awesome, ", "oh nice, ",
            "brilliant, ", "wow, ", "ok great, ", "cheers, ", "that's it, ", "yes, ", "nice one, ", "amazing, "]
CLOSE_POS = ["", "", "", " thanks!", " thank you so much", " 🙏", " 🎉", "!", " :)", " you're a lifesaver",
             " appreciate it", " really helpful", " much clearer now", " exactly what I needed", " great job",
             " 👍", " love it", ", thanks a lot"]
OPEN_NEG = ["", "", "", "hmm, ", "no, ", "nope, ", "ugh, ", "sorry but ", "well, ", "uh, ", "that's wrong: ",
            "doesn't work: ", "not quite, ", "actually ", "wait, "]
CLOSE_NEG = ["", "", "", " 😞", ".", "!", " again", " please fix it", " can you fix that?", " 🙄",
             " what now?", " any idea why?", " try again", " this is frustrating"]
THANKS_BUT = ["thanks, but {f}", "appreciate it, but {f}", "looks nice but {f}", "great effort, but {f}",
              "thank you! unfortunately {f}", "that's kind, however {f}", "I like the idea but {f}",
              "nice try, but {f}", "thanks for the quick reply, but {f}", "good start but {f}",
              "the explanation was clear, but {f}", "it looks great, except {f}"]
IRONY = ["oh great, {f}", "wow, really helpful. {f}", "fantastic. {f}", "brilliant, just brilliant. {f}",
         "perfect, exactly what I wanted: {f}", "love how {f}", "well done, {f}", "amazing, {f}. thanks a lot.",
         "yeah sure, great answer. {f}", "oh wonderful, {f}", "cool cool cool. {f}", "just what I needed: {f}"]
TASTE = ["{s}. maybe a touch long, but I'm using it as is", "{s}, though I swapped one word", "{s}. "
         "I'd have picked another name but it works", "{s}; the second paragraph is a bit much, but fine",
         "{s}. not my favourite font choice but whatever", "{s}, even if the joke is a bit corny",
         "{s}. a little verbose but spot on"]
POS_THEN_Q = ["{s}. one more thing: {q}", "{s}! {q}", "{s}, thanks. next, {q}", "{s}. now {q}"]
USE = ["sending it now", "I'll go with this one", "using it as is", "posting it tonight", "printing it",
       "merging it", "that's going straight into the report", "copying it into my notes", "shipping it"]

AFTER_POS = ["I was worried it would take all day", "I had been stuck on this for a week",
             "I did not expect it to be that simple", "my colleague had no idea either"]
AFTER_NEG = ["I have spent an hour on this already", "this is the third attempt", "I need this done today",
             "I followed every step"]
WHEN_POS = ["this morning", "last night", "right away", "after lunch"]
DEFER_OPEN = ["thanks, ", "ok, ", "looks promising, ", "interesting, "]
QUESTION_OPEN = ["ok, ", "hmm, ", "and ", "one thing: "]
QUESTION_CLOSE = ["", "just curious", "asking for later"]

# -- other languages: (+1, -1, 0) sentences written for this bank ---------------------------------------------
LANG = {
    "de": (["danke, läuft jetzt", "perfekt, genau so wollte ich das", "hat funktioniert, vielen Dank!",
            "super, die Tests sind grün", "stimmt, das Ergebnis passt", "klasse, meine Chefin war begeistert",
            "jetzt klappt es endlich", "genau richtig, danke dir", "top, hab's direkt verschickt",
            "die Rechnung stimmt, danke"],
           ["nein, das ist falsch", "funktioniert immer noch nicht", "das war nicht die Frage",
            "jetzt kommt ein anderer Fehler", "zu lang, ich wollte drei Sätze",
             "das Ergebnis ist falsch, es muss 8 sein",
            "leider geht es nicht, gleicher Fehler", "du hast die Hälfte vergessen", "schon wieder falsch",
            "danke, aber es stürzt immer noch ab"],
           ["ich probiere es heute Abend", "was bedeutet das genau?", "alles klar", "und wie geht das unter Windows?",
            "muss ich noch testen", "andere Frage: wie spät ist es in Tokio?", "hm, na gut",
             "moment, ich schaue nach"]),
    "fr": (["merci, ça marche", "parfait, c'est exactement ça", "nickel, les tests passent",
            "génial, je l'ai envoyé tel quel", "c'est juste, merci beaucoup", "top, ça fonctionne enfin",
            "le calcul est bon, merci", "super, ma prof a validé"],
           ["non, c'est faux", "ça ne marche toujours pas", "ce n'est pas ce que j'ai demandé",
            "trop long, j'avais dit trois lignes", "même erreur qu'avant", "le résultat est faux, c'est 12",
            "merci mais ça plante encore", "tu as oublié la moitié", "encore raté"],
           ["je teste ce soir", "ça veut dire quoi exactement ?", "d'accord", "et sous Mac ?", "je verrai demain",
            "autre question : il fait beau à Nice ?", "bon", "attends, je regarde"]),
    "es": (["gracias, funciona", "perfecto, justo lo que necesitaba", "ya compila, muchas gracias",
            "genial, lo envié tal cual", "correcto, me da lo mismo a mano", "buenísimo, a mi jefe le encantó",
            "funcionó a la primera", "exacto, gracias"],
           ["no, está mal", "sigue sin funcionar", "eso no es lo que pedí", "demasiado largo, pedí dos líneas",
            "el mismo error de antes", "el resultado es incorrecto, debería ser 5", "gracias pero sigue fallando",
            "otra vez mal", "te olvidaste de la mitad"],
           ["lo pruebo esta noche", "¿qué significa eso?", "vale", "¿y en Linux?", "luego te digo",
            "otra pregunta: ¿qué hora es en Lima?", "mmm", "espera, lo miro"]),
    "pt": (["obrigado, funcionou", "perfeito, era isso mesmo", "deu certo, valeu!", "ótimo, já mandei",
            "correto, bate com o gabarito", "show, os testes passaram"],
           ["não, está errado", "continua sem funcionar", "não foi isso que pedi", "muito longo, pedi um parágrafo",
            "o mesmo erro de antes", "obrigado, mas ainda dá erro", "o valor está errado, deveria ser 9"],
           ["vou testar amanhã", "o que isso quer dizer?", "beleza", "e no Windows?", "depois te falo", "hum, tá"]),
    "it": (["grazie, funziona", "perfetto, proprio quello che volevo", "esatto, torna tutto", "ottimo, l'ho inviato"],
           ["no, è sbagliato", "non funziona ancora", "non è quello che ho chiesto", "troppo lungo", "stesso errore"],
           ["lo provo stasera", "cosa vuol dire?", "va bene", "e su Mac?"]),
    "nl": (["bedankt, het werkt", "perfect, precies wat ik zocht", "klopt, dank je"],
           ["nee, dat klopt niet", "werkt nog steeds niet", "dat is niet wat ik vroeg"],
           ["ik probeer het morgen", "wat betekent dat?", "oké"]),
    "ru": (["спасибо, работает", "отлично, именно то, что нужно", "всё сошлось, спасибо"],
           ["нет, это неправильно", "всё ещё не работает", "я просил другое", "опять та же ошибка"],
           ["попробую вечером", "а что это значит?", "ок"]),
    "zh": (["谢谢，可以运行了", "完美，就是这个", "答案对了，谢谢", "太好了，测试都通过了", "好的，已经发出去了，谢谢"],
           ["不对，应该是12", "还是报错", "这不是我要的", "太长了，我只要三句", "还是不行，一样的错误", "谢谢，但是还是不能用"],
           ["我晚上试试", "这是什么意思？", "好", "那在Windows上呢？", "等一下"]),
    "ja": (["ありがとう、動きました", "完璧です、まさにこれです", "正しいです、助かりました", "テストが通りました、ありがとう"],
           ["違います、12です", "まだエラーが出ます", "そういう意味ではありません", "長すぎます", "ありがとう、でも動かないです"],
           ["あとで試してみます", "これはどういう意味ですか？", "なるほど", "ちょっと待って"]),
    "ko": (["감사합니다, 잘 돼요", "완벽해요", "맞아요, 고마워요"],
           ["아니요, 틀렸어요", "아직도 오류가 나요", "그게 아니라 다른 거요"],
           ["나중에 해볼게요", "이게 무슨 뜻이에요?", "네"]),
    "tr": (["teşekkürler, çalıştı", "mükemmel, tam istediğim gibi"], ["hayır, yanlış", "hâlâ çalışmıyor"],
           ["yarın denerim", "bu ne demek?"]),
    "pl": (["dzięki, działa", "idealnie, o to chodziło"], ["nie, to jest źle", "dalej nie działa"],
           ["sprawdzę jutro", "co to znaczy?"]),
    "sv": (["tack, det fungerar", "perfekt, precis så"], ["nej, det är fel", "fungerar fortfarande inte"],
           ["jag testar i kväll", "vad betyder det?"]),
}


def _fill(rng: random.Random, s: str) -> str:
    for key, values in FILL.items():
        while "{" + key + "}" in s:
            s = s.replace("{" + key + "}", rng.choice(values), 1)
    return s


def _cap(rng: random.Random, s: str) -> str:
    s = " ".join(s.split())
    r = rng.random()
    if r < 0.45:
        return s[:1].upper() + s[1:]
    if r < 0.55:
        return s.lower().rstrip(".!")
    return s


def generated_examples(seed: int = 12, per_domain: int = 90) -> list[dict]:
    """The generated user replies (module docstring): about ``per_domain`` rows of each
    kind per domain plus the other languages; deterministic for a seed."""
    rng = random.Random(seed)
    out: list[tuple[str, int]] = []

    def add(text: str, label: int) -> None:
        out.append((_cap(rng, _fill(rng, text)), label))

    for dom in THINGS:
        things, succ, fail = THINGS[dom], SUCCESS[dom], FAILURE[dom]
        for _ in range(per_domain):
            k = rng.random()
            s = rng.choice(succ)
            if k < 0.3:
                add(rng.choice(OPEN_POS) + s + rng.choice(CLOSE_POS), 1)
            elif k < 0.5:
                add(f"{rng.choice(OPEN_POS)}{rng.choice(things)} worked. {s}{rng.choice(CLOSE_POS)}", 1)
            elif k < 0.62:
                add(rng.choice(TASTE).format(s=rng.choice(OPEN_POS) + s), 1)
            elif k < 0.74:
                add(rng.choice(POS_THEN_Q).format(s=s, q=rng.choice(NEUTRAL["question"])), 1)
            elif k < 0.86:
                add(f"{rng.choice(OPEN_POS)}{s}. {rng.choice(USE)}{rng.choice(CLOSE_POS)}", 1)
            else:
                long = (f"{rng.choice(['So', 'OK so', 'Update:', 'Just to let you know,'])} I tried "
                        f"{rng.choice(things)} {rng.choice(WHEN_POS)}"
                        f" and {s}. {rng.choice(AFTER_POS)}."
                        f"{rng.choice(CLOSE_POS)}")
                add(long, 1)
        for _ in range(per_domain):
            k = rng.random()
            f = rng.choice(fail)
            if k < 0.3:
                add(rng.choice(OPEN_NEG) + f + rng.choice(CLOSE_NEG), -1)
            elif k < 0.48:
                add(rng.choice(THANKS_BUT).format(f=f), -1)
            elif k < 0.62:
                add(rng.choice(IRONY).format(f=f), -1)
            elif k < 0.8:
                x, y = rng.choice(PAIRS)
                add(rng.choice(OPEN_NEG) + rng.choice(CORRECTIONS).format(x=x, y=y), -1)
            elif k < 0.9:
                add(f"I tried {rng.choice(things)} and {f}.{rng.choice(CLOSE_NEG)}", -1)
            else:
                long = (f"{rng.choice(['So', 'OK so', 'Update:', 'Well,'])} I tried {rng.choice(things)} "
                        f"{rng.choice(['this morning', 'twice', 'on a clean setup', 'exactly as you wrote'])} and "
                        f"{f}. {rng.choice(AFTER_NEG)}."
                        f"{rng.choice(CLOSE_NEG)}")
                add(long, -1)
        for _ in range(per_domain):
            kind = rng.choice(["question", "question", "defer", "defer", "ack", "topic", "smalltalk", "info"])
            t = rng.choice(NEUTRAL[kind])
            if kind == "topic":
                t = t.replace("{q}", rng.choice(FILL["q"]))
            elif kind == "defer" and rng.random() < 0.4:
                t = f"{rng.choice(DEFER_OPEN)}{t}"
            elif kind == "question" and rng.random() < 0.3:
                t = f"{rng.choice(QUESTION_OPEN)}{t} {rng.choice(QUESTION_CLOSE)}"
            add(t, 0)
    for lang, (pos, neg, neu) in LANG.items():
        for label, texts in ((1, pos), (-1, neg), (0, neu)):
            for t in texts:
                out.append((t, label))
                if label and rng.random() < 0.5:
                    out.append((t + rng.choice(["!", " 🙏", " 👍"] if label == 1 else ["...", " 😞", "!!"]), label))
    seen, rows = set(), []
    for text, label in out:
        key = text.lower().strip()
        if key in seen:
            continue
        seen.add(key)
        rows.append({"text": text, "label": label, "role": "user", "source": "bank"})
    return rows
